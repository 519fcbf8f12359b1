"""Context parallelism (cp) on the torch backend: each sequence sharded over the cp ranks.

Layout: the batch (the same on every rank of a cp group: cp peers share a data rank) is padded at
the end to a multiple of cp and cut into cp contiguous shards along the sequence; cp rank r runs
the network on tokens [r·n, (r+1)·n) with their global positions (so RoPE is the unsharded one).
Attention is the only place tokens meet: our attention function (registered with transformers as
`twinkle_cp`) all-gathers K and V over the cp group and masks causally by global position, so each
query sees exactly the keys it sees in one process. The all-gather's backward sums every rank's
gradient for a shard's K/V back into the rank that produced it.

The loss: targets are shifted on the whole sequence before it is cut (the target of a shard's last
token is the next shard's first), so each rank's loss covers its own tokens; ranks then reduce
like data-parallel ranks (`strategy.data_parallel_loss` over dp x cp, gradients averaged by DDP
over dp x cp), which makes loss and gradients those of one process on the whole batch.

What it refuses, by name: left padding or holes in the attention mask, and packed rows (both need
a per-row mask across the split; only trailing padding is causal-safe without one), images,
sliding-window attention, and losses that read whole sequences (a shard holds part of one).
Contiguous shards leave the last rank the most attention work (no zig-zag balancing yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from twinkle.data_format.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from twinkle.loss.base import Loss

ATTENTION_NAME = "twinkle_cp"
# The shard the latest forward computed. Set by `Shard.activate` and left in place until the next
# forward: activation checkpointing recomputes attention during backward, after the forward returned.
_current: Shard | None = None


@dataclass
class Shard:
    group: dist.ProcessGroup | None  # the cp process group (None: the default group)
    rank: int
    size: int
    start: int  # first global position of this rank's tokens
    length: int  # the padded global length (size x tokens per rank)

    def activate(self) -> Shard:
        global _current
        _current = self
        return self

    def gather(self, local_B_T: torch.Tensor) -> torch.Tensor:
        """The whole (padded) sequence from every rank's shard, along dim 1 (no gradient)."""
        parts = [torch.empty_like(local_B_T) for _ in range(self.size)]
        dist.all_gather(parts, local_B_T.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence dim (2 of [B, H, T, D]); backward sums the ranks' gradients
    (all-reduce, which gloo has; it lacks reduce-scatter) and keeps this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, shard: Shard) -> torch.Tensor:  # ctx: torch's, carrying `shard`
        ctx.shard = shard
        parts = [torch.empty_like(x) for _ in range(shard.size)]
        dist.all_gather(parts, x.contiguous(), group=shard.group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None]:
        shard = ctx.shard
        grad = grad_outputs[0].contiguous()
        dist.all_reduce(grad, group=shard.group)
        return grad.chunk(shard.size, dim=2)[shard.rank].contiguous(), None


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # noqa: ARG001 - causal by global position instead
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; query/key/value are [B, H, T_local, D]."""
    shard = _current
    if shard is None:
        raise RuntimeError("twinkle_cp attention ran outside a context-parallel forward (no shard is active)")
    if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
        raise ValueError("context parallelism does not implement sliding-window attention layers")
    key, value = _GatherSequence.apply(key, shard), _GatherSequence.apply(value, shard)
    q_pos = torch.arange(shard.start, shard.start + query.shape[2], device=query.device)
    allowed = torch.arange(key.shape[2], device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=allowed,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def enable(hf_model: PreTrainedModel) -> None:
    """Route the model's attention through `attention` (registered once, by name)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)
    config = hf_model.config
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (
        getattr(config, "layer_types", None) or ()
    ):
        raise ValueError(
            f"context parallelism does not implement sliding-window attention, which {type(config).__name__} uses"
        )
    hf_model.set_attn_implementation(ATTENTION_NAME)


def check_loss(loss: Loss) -> None:
    from twinkle.loss.policy import GSPOLoss
    from twinkle.loss.preference import PairLoss

    if isinstance(loss, (PairLoss, GSPOLoss)):
        raise ValueError(
            f"{type(loss).__name__} reads whole sequences (per-row sums or ratios), but under context "
            f"parallelism each rank holds a part of every row: use cp_size=1 for it"
        )


def shard_batch(
    batch: dict[str, torch.Tensor],
    targets_B_T: torch.Tensor,
    fields: dict[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    rank: int,
    size: int,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor], Shard]:
    """(this rank's model inputs, targets, per-token fields, its Shard). `targets_B_T` and `fields`
    are already shifted (length T-1); they are padded to the shard layout here."""
    if "pixel_values" in batch:
        raise ValueError("context parallelism does not implement image inputs: use cp_size=1 for vision batches")
    ids = batch["input_ids"]
    T = ids.shape[1]
    mask = batch.get("attention_mask")
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    natural = torch.arange(T, device=ids.device).expand_as(ids)
    if mask is not None and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "context parallelism needs right padding: the attention mask has padding before real tokens "
            "(left padding or holes), which causal attention across the split cannot mask"
        )
    if "position_ids" in batch and not torch.equal(batch["position_ids"][real], natural[real]):
        raise ValueError(
            "context parallelism does not implement packed rows (position_ids restarting inside a row): "
            "the split would need a per-sequence mask across ranks; pad the rows instead"
        )
    padded = -(-T // size) * size
    n = padded // size
    start = rank * n
    local_ids = _cut(ids, padded, start, n)  # pad ids are never a target
    targets = _cut(targets_B_T, padded, start, n, value=IGNORE_INDEX)
    local_fields = {k: (_cut(v, padded, start, n) if v.dim() >= 2 else v) for k, v in fields.items()}
    positions = torch.arange(start, start + n, device=ids.device).expand(ids.shape[0], n)
    model_batch = {"input_ids": local_ids, "position_ids": positions, "labels": targets}
    return model_batch, targets, local_fields, Shard(group, rank, size, start, padded)


def _cut(t: torch.Tensor, padded: int, start: int, n: int, value: int = 0) -> torch.Tensor:
    """Pad dim 1 of t at the end to `padded`, then keep [start, start + n) of it."""
    pad = [0, 0] * (t.dim() - 2) + [0, padded - t.shape[1]]
    return F.pad(t, pad, value=value)[:, start : start + n]
