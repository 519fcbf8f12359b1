"""One fused pass of MultiLoraModel: every tenant's rows through one base pass (`PassModel.heads`), then
each tenant's loss on its own rows and its own records, and one backward of the weighted sum.

A tenant whose input or loss fails maps to its exception; the others still train. Kept apart from the
model's adapter bookkeeping (model.py) because this is the part a reader follows to see what a pass
computes and how its time and FLOPs are shared out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.loss import LossContext
from twinkle.metric import ForwardRecord
from twinkle.model import embedding_pass
from twinkle.model.multi_lora.batch import Batch
from twinkle.model.state import AdapterState


@dataclass(frozen=True)
class PassModel:
    """What a pass needs of its model: `heads(segments, train, task)` runs the one base pass and answers
    each segment's head; `flops(state, batch, train)` a tenant's share; `peak_flops` for its MFU."""

    heads: Callable
    flops: Callable[[AdapterState, Batch, bool], float]
    device: torch.device
    peak_flops: float | None


def reference_logps(model: PassModel, work: list[tuple[AdapterState, Batch]], losses: dict) -> dict[str, torch.Tensor]:
    """log p(target) under the base model (adapter off), for tenants whose loss needs it."""
    needing = [(s.name, b) for s, b in work if losses.get(s.name, s.loss).needs_reference(b.fields)]
    if not needing:
        return {}
    out = {}
    with torch.no_grad():
        ref_heads = model.heads([(None, b) for _, b in needing], train=False)
        for (name, b), head in zip(needing, ref_heads):
            out[name] = head.target_logps(b.labels_B_T[:, 1:].to(model.device)).detach()
    return out


def run(
    model: PassModel,
    work: list[tuple[AdapterState, Batch]],
    train: bool,
    return_logprobs: bool,
    weights: dict,
    losses: dict,
    task: str = "causal_lm",
) -> dict:
    start = time.perf_counter()
    embedding = task == embedding_pass.EMBEDDING
    # tenants with equally many rows and equal ranks next to each other: each layer runs them as one bmm
    work = sorted(work, key=lambda item: (item[1].rows, item[0].spec.rank))
    refs = {} if embedding else reference_logps(model, work, losses)  # a forward-only pass scores its loss too
    pass_heads = model.heads([(s.name, b) for s, b in work], train, task)
    outcomes, records, total = {}, {}, None
    for (state, batch), head in zip(work, pass_heads):
        targets_B_T = batch.labels_B_T[:, 1:].to(model.device)
        fields = {k: v.to(model.device) for k, v in batch.shifted_fields().items()}
        try:
            ctx = LossContext(head, targets_B_T, fields, refs.get(state.name))
            loss_fn = losses.get(state.name, state.loss)
            if embedding:
                scored = embedding_pass.wants_loss(train, loss_fn, fields)
            else:
                scored = bool((targets_B_T != IGNORE_INDEX).any())
            out = loss_fn(ctx) if scored else None
        except (ValueError, KeyError, TypeError) as error:
            outcomes[state.name] = error
            continue
        loss = float(out.loss.detach()) if out is not None else float("nan")
        finite = out is not None and torch.isfinite(out.loss).item()
        if train and finite:
            scaled = out.loss * weights.get(state.name, 1.0) / state.gradient_accumulation_steps
            total = scaled if total is None else total + scaled
        with torch.no_grad():
            mask_B_T = targets_B_T != IGNORE_INDEX
            correct = int((head.correct(targets_B_T) & mask_B_T).sum())
        records[state.name] = ForwardRecord(
            loss=loss,
            loss_tokens=int(mask_B_T.sum()),
            input_tokens=batch.tokens,
            correct_tokens=correct,
            seconds=0.0,
            flops=model.flops(state, batch, train),
            finite=bool(finite),
            extras=dict(out.metrics) if out else {},
        )
        result = {
            "loss": loss,
            "loss_tokens": records[state.name].loss_tokens,
            "finite": bool(finite),
            "metrics": dict(out.metrics) if out else {},
        }
        if embedding and not train:
            result["embeddings"] = head.embeddings().tolist()
        elif return_logprobs and not embedding:
            lengths = batch.attention_mask_B_T.sum(1).tolist()
            logps = ctx.scored_logps().detach().cpu()  # [B, T] or [B, T, K]
            result["logprobs"] = [logps[i, : int(L) - 1].tolist() for i, L in enumerate(lengths)]
        outcomes[state.name] = result
    if total is not None:
        total.backward()
    # The pass's wall time is shared out by tokens: a tenant's throughput counts only its rows.
    seconds, all_tokens = time.perf_counter() - start, sum(b.tokens for _, b in work)
    for state, batch in work:
        if state.name in records:
            record = records[state.name]
            record.seconds = seconds * batch.tokens / max(all_tokens, 1)
            if record.seconds > 0 and model.peak_flops:  # this tenant's share of the pass, as a fraction of peak
                outcomes[state.name]["mfu"] = record.flops / record.seconds / model.peak_flops
            for metric in state.metrics(train):
                metric.on_forward(records[state.name])
            if train:
                state.count_micro_batch(records[state.name].finite)
    return outcomes
