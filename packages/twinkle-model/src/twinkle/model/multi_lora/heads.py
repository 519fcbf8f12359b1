"""Per-tenant next-token heads of one fused pass, without `[rows x tokens x vocab]` logits for long ones.

Short passes keep the model's own logits (`LogitsHead`): the exact kernels every earlier result came
from. When a pass's logits would exceed `logits_budget_bytes` the base runs without its unembedding
and each tenant gets a head over its rows' hidden states: the library's `ChunkedHead` (one sweep over
the vocabulary per chunk, no recompute) for a tenant without a LoRA on the unembedding, and a
`ProjectedHead` (the unembedding with that tenant's LoRA on it; each head holds one tenant's rows, so
no routing; recomputed per chunk in backward) for one with. Either way a 32K-token row costs
`chunk x vocab` floats of head memory instead of `32K x vocab`.

A pass that may pause (twinkle.model.preemption: a served job's handler is on) takes the chunked head
once its unembedding is more than one pause unit of work, in chunks of about one unit each, so that
the unembedding and its backward are not one long stretch other tenants wait behind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkle.loss.head import LOGITS_BUDGET_BYTES, ChunkedHead, LogitsHead, ProjectedHead, TokenHead
from twinkle.model import preemption

__all__ = ["LOGITS_BUDGET_BYTES", "heads", "wants_chunks"]
CHUNK_TOKENS = 4096


def wants_chunks(model, segments, train: bool, budget: int) -> bool:
    """Whether this pass's full logits would exceed `budget` and the unembedding can be chunked:
    no logit soft-capping, and no tenant of a training pass draws dropout on it (a recompute would
    draw another mask)."""
    config = model.base.config
    if getattr(config, "final_logit_softcapping", None):
        return False
    rows = sum(b.rows for _, b in segments)
    length = max(b.length for _, b in segments)
    vocab, hidden = model.base.get_output_embeddings().weight.shape
    pausing = preemption.active() and rows * length * vocab * hidden > preemption.CHUNK_MACS
    if rows * length * vocab * 4 <= budget and not pausing:
        return False
    head = model.base.get_output_embeddings()
    dropout = getattr(head, "dropout", {})
    return not (train and any(dropout.get(name) for name, _ in segments if name is not None))


def _projection(model, name: str | None):
    """The unembedding for one tenant's rows as plain autograd ops (base projection plus that tenant's
    low-rank term, if it trains one there). Not the MultiLoraLinear itself: it routes by the whole
    pass's rows, while a head chunk holds one tenant's rows, and the pass's routing is gone by the
    time backward recomputes the chunk."""
    head = model.base.get_output_embeddings()
    base = getattr(head, "base_layer", head)
    lora_a = getattr(head, "lora_A", {})
    if name is None or name not in lora_a:
        return base
    a_R_H, b_V_R = head.factors(name)
    scaling = head.scaling[name]

    def project(hidden_B_t_H: torch.Tensor) -> torch.Tensor:
        low = F.linear(F.linear(hidden_B_t_H.to(a_R_H.dtype), a_R_H), b_V_R)
        return base(hidden_B_t_H) + scaling * low.to(base.weight.dtype)

    return project


def heads(model, segments, train: bool, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor, images: dict) -> list[TokenHead]:
    """One head per segment (tenant name or None, Batch), already shifted: [rows, length - 1]. `images`:
    the pass's image inputs; such a pass keeps whole logits (the decoder alone would not see the images)."""
    chunked = not images and wants_chunks(model, segments, train, model.logits_budget_bytes)
    kwargs = {"input_ids": ids_B_T, "attention_mask": mask_B_T, "use_cache": False, **images}
    out = model.base.get_decoder()(**kwargs).last_hidden_state if chunked else model.base(**kwargs).logits
    result, offset = [], 0
    for name, batch in segments:
        n, T = batch.rows, batch.length
        part = out[offset : offset + n, : T - 1]
        offset += n
        project = _projection(model, name) if chunked else None
        if isinstance(project, torch.nn.Linear):
            result.append(ChunkedHead(part, project.weight, project.bias, chunk_size=_pausing_chunk(model)))
        elif project is not None:  # chunked
            result.append(ProjectedHead(part, project, _pausing_chunk(model) or CHUNK_TOKENS))
        else:
            result.append(LogitsHead(part))
    return result


def _pausing_chunk(model) -> int | None:
    """Positions (all rows together) per head chunk in a pass that may pause: about one pause unit of
    work, at least preemption.MIN_CHUNK; None (the head's own size) otherwise."""
    if not preemption.active():
        return None
    vocab, hidden = model.base.get_output_embeddings().weight.shape
    return max(preemption.MIN_CHUNK, preemption.CHUNK_MACS // max(1, vocab * hidden))
