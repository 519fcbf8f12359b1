"""twinkle-kit's `task='embedding'` on TransformersModel: a pass whose output is one embedding per input
sequence (`twinkle.loss.EmbeddingHead`: the last real token's final hidden state, L2-normalised), for
contrastive losses (`InfonceLoss`). The model runs with its output projection skipped, so no logits
exist at all.

twinkle-kit's embedding rows carry one number as `labels`: 1 on a group's anchor, 0 on its positive and
negatives. Here that number becomes the row's `group_start` and the row has no token targets.

MultiLoraModel runs the same pass for several tenants at once (`fused_heads`): one run of the base with its
output projection skipped, each tenant's rows pooled into its own EmbeddingHead.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.loss import EmbeddingHead, Loss
from twinkle.model import output_projection
from twinkle.model.inputs import sequence_spans
from twinkle.model.kit import check_task

CAUSAL_LM, EMBEDDING = "causal_lm", "embedding"


def task_inputs(task: str, inputs):
    """`inputs` as the pass of `task` reads them (refusing a task not offered)."""
    check_task(task)
    if task != EMBEDDING:
        return inputs
    if isinstance(inputs, Mapping):
        return _collated(inputs)
    return [_row(row, i) for i, row in enumerate(inputs)]


def _row(row, i: int) -> dict:
    if not isinstance(row, Mapping) or "input_ids" not in row:
        raise ValueError(f"task='embedding' takes encoded rows (dicts with input_ids); row {i} is not one")
    out = dict(row)
    if "group_start" not in out:
        label = out.pop("labels", None)
        label = label.tolist() if isinstance(label, torch.Tensor) else label
        label = label if not isinstance(label, (list, tuple)) else (label[0] if len(label) == 1 else None)
        if label is None:
            raise ValueError(
                f"embedding row {i}: its `labels` must be one number (1 on a group's anchor, 0 on the "
                "rest), or the row gives `group_start`"
            )
        out["group_start"] = int(label)
    out["labels"] = [IGNORE_INDEX] * len(out["input_ids"])
    return out


def _collated(batch: Mapping) -> dict:
    ids_N_T = torch.as_tensor(batch["input_ids"])
    out = dict(batch)
    if "group_start" not in out:
        out["group_start"] = torch.as_tensor(out.pop("labels")).reshape(-1).long()
    if out["group_start"].numel() != ids_N_T.shape[0]:
        raise ValueError(f"{out['group_start'].numel()} group marks for {ids_N_T.shape[0]} rows")
    out["labels"] = torch.full_like(ids_N_T, IGNORE_INDEX)
    return out


def wants_loss(train: bool, loss: Loss, fields: Mapping) -> bool:
    """Whether an embedding pass computes its loss: always when it trains (a token loss then refuses the
    pass by name), without gradients only when the loss is an embedding loss and the rows form whole
    groups. Rows that do not (anchors alone: what twinkle-kit's emb_sample embeds) get embeddings only."""
    if train:
        return True
    return "group_start" in loss.required_fields and "group_start" in fields and whole_groups(fields["group_start"])


def whole_groups(group_start) -> bool:
    """Whether the rows' marks (1 on an anchor, 0 on the rest) make groups of an anchor and at least one
    more row, the first row an anchor."""
    marks = torch.as_tensor(group_start).reshape(-1).tolist()
    starts = [i for i, mark in enumerate(marks) if mark == 1]
    if not starts or starts[0] != 0:
        return False
    return all(end - start >= 2 for start, end in zip(starts, [*starts[1:], len(marks)]))


def fused_heads(model, rows_per_segment: list[int], **model_kwargs) -> list[EmbeddingHead]:
    """One run of `model` with its output projection skipped over stacked, right-padded rows
    (`model_kwargs`: input_ids, attention_mask, image inputs); each segment's rows pooled into its head."""
    with output_projection.skipped(model.get_output_embeddings(), True):
        hidden_B_T_H = model(**model_kwargs, use_cache=False).logits
    spans = sequence_spans({"input_ids": model_kwargs["input_ids"], "attention_mask": model_kwargs["attention_mask"]})
    heads, first = [], 0
    for n in rows_per_segment:
        heads.append(EmbeddingHead.pooled(hidden_B_T_H, spans[first : first + n]))
        first += n
    return heads


class EmbeddingTaskMixin:
    """Mixed into TransformersModel: `forward_only(inputs, task='embedding')`."""

    def embedding_forward_only(self, inputs, adapter_name: str | None, task: str) -> dict:
        """Each row's embedding, and the loss when the set loss is an embedding loss (it reads
        `group_start`) and the rows mark their groups."""
        inputs = task_inputs(task, inputs)  # refuses a task not offered
        state = self._state(adapter_name)  # ty: ignore[missing-attribute] - the engine's
        t0 = time.perf_counter()
        with torch.no_grad():
            ctx = self.forward(inputs, adapter_name, _grad=False, task=task)  # ty: ignore[missing-attribute]
            wanted = wants_loss(False, state.loss, ctx.fields)
            out = self.calculate_loss(ctx, adapter_name) if wanted else None  # ty: ignore[missing-attribute]
        self._record(state, ctx, out, time.perf_counter() - t0, training=False)  # ty: ignore[missing-attribute]
        self.last_eval_loss = float(out.loss) if out is not None else None
        # a tensor [rows, hidden], as twinkle-kit's (its scripts slice and compare them); data ranks' are
        # concatenated in rank order (twinkle.mesh.dispatch's merge)
        return {"loss": self.last_eval_loss, "embeddings": ctx.head.embeddings().detach().cpu()}
