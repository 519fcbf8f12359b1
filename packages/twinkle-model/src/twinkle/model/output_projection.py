"""The model's unembedding, skipped during a forward whose head is computed in chunks.

A chunked pass calls the whole model (wrappers, hooks, DDP and all) with the output projection
replaced by the identity for that one call, so `outputs.logits` holds the final hidden states and
`twinkle.loss.ChunkedHead` applies the projection's own weight a chunk at a time. The projection
stays registered where it was: state dicts, saving and optimizers never notice.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from twinkle.loss.head import ChunkedHead, chunk_positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def check_chunkable(hf_model: PreTrainedModel) -> torch.nn.Linear:
    """The output projection, or a ValueError naming why its logits cannot be computed in chunks."""
    config = hf_model.config
    if getattr(config, "final_logit_softcapping", None):
        raise ValueError(f"{config.model_type} soft-caps its logits; a chunked head does not support that")
    head = hf_model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):  # peft's LoRA-wrapped head is no Linear
        raise ValueError(f"a chunked head needs a Linear output projection, found {type(head).__name__}")
    return head


def default_chunk(hf_model: PreTrainedModel, positions: int, budget_bytes: int) -> int | None:
    """Positions per chunk when a pass of `positions` would hold more fp32 logits than `budget_bytes`
    and this model's head can be chunked, else None (whole logits): a LoRA on the head, soft-capped
    logits and a sharded (tp / FSDP2) projection keep whole logits."""
    try:
        head = check_chunkable(hf_model)
    except ValueError:
        return None
    if positions * head.out_features * 4 <= budget_bytes or isinstance(head.weight, DTensor):
        return None
    return chunk_positions(head.out_features)


def chunked_head(
    hidden_B_T_H: torch.Tensor,
    projection: torch.nn.Linear,
    chunk: int,
    dtype: torch.dtype | None,
    local: Callable[[torch.Tensor], torch.Tensor],
) -> ChunkedHead:
    """The head over hidden states; `dtype`: the autocast dtype the projection would have multiplied in;
    `local`: a sharded parameter's local part."""
    weight = local(projection.weight)
    if dtype is not None:
        hidden_B_T_H, weight = hidden_B_T_H.to(dtype), weight.to(dtype)
    bias = local(projection.bias) if projection.bias is not None else None
    return ChunkedHead(hidden_B_T_H, weight, bias, chunk)


def _identity(hidden_states: torch.Tensor) -> torch.Tensor:
    return hidden_states


@contextmanager
def skipped(projection: torch.nn.Module, skip: bool) -> Generator[None]:
    if not skip:
        yield
        return
    projection.forward = _identity  # an instance attribute shadows the class's forward for this call
    try:
        yield
    finally:
        del projection.forward
