"""twinkle-kit's `logps` in forward_only / forward_backward outputs, and outputs joined across passes.

twinkle-kit returns `logps` as one float tensor [rows, longest row]: position t holds log p(token t+1 |
tokens <= t) (its labels are shifted left by one), right-padded. Ours holds 0 where a position has no
label (twinkle-kit gathers token 0 there; its losses mask those positions either way) and past each
row's end. Our own `logprobs` (per row, aligned with the tokens, 0 first) is unchanged beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from twinkle.loss import ValueHead
from twinkle.mesh.dispatch import collect_results
from twinkle.model import inputs as model_inputs

if TYPE_CHECKING:
    from twinkle.loss import LossContext

PADDING = {"routed_experts": -1}  # what a joined tensor holds past a row's end; 0 for the others


def row_logps(ctx: LossContext) -> torch.Tensor | None:
    """`logps` of a pass's context: [rows, longest row], one row per input sequence (packed rows too);
    None for a head without token log-probs (a value model's)."""
    if isinstance(ctx.head, ValueHead):
        return None
    with torch.no_grad():
        logps_B_T = ctx.logps_B_T.detach().float()
        if ctx.shard is not None:  # every cp rank returns the whole rows
            logps_B_T = ctx.shard.gather(logps_B_T)[:, : ctx.batch["input_ids"].shape[1] - 1]
    spans = model_inputs.sequence_spans(ctx.batch)
    out_R_T = logps_B_T.new_zeros(len(spans), max(n for _, _, n in spans))
    for r, (b, s, n) in enumerate(spans):
        out_R_T[r, : n - 1] = logps_B_T[b, s : s + n - 1]
    return out_R_T.cpu()


def pad_cat(parts: Sequence[torch.Tensor], value: float = 0) -> torch.Tensor:
    """Row blocks of different widths (dim 1) as one tensor, each right-padded with `value`."""
    width = max(p.shape[1] for p in parts)
    padded = []
    for p in parts:
        pad = p.new_full((p.shape[0], width - p.shape[1], *p.shape[2:]), value)
        padded.append(torch.cat([p, pad], 1))
    return torch.cat(padded)


def joined_logps(parts: Sequence[torch.Tensor | None]) -> dict:
    """{'logps': the passes' logps as one} (nothing when a pass had none)."""
    if not parts or any(p is None for p in parts):
        return {}
    return {"logps": pad_cat([p for p in parts if p is not None])}


def join_passes(outs: Sequence[dict], weights: Sequence[float]) -> dict:
    """Outputs of passes over consecutive rows as one: row values in order, the loss weighted."""
    joined: dict[str, Any] = {}
    for key in outs[0]:
        values = [o[key] for o in outs]
        if key == "loss":
            finite = all(v is not None for v in values)
            joined[key] = sum(v * w for v, w in zip(values, weights)) if finite else None
        elif isinstance(values[0], torch.Tensor):
            joined[key] = pad_cat(values, PADDING.get(key, 0))
        else:
            joined[key] = [row for v in values for row in v]
    return joined


def merge_ranks(results: list) -> Any:
    """A remote group's collect: the ranks' dicts merged ('merge'), their row tensors padded to one width first."""
    if isinstance(results[0], dict):
        for key, value in results[0].items():
            if isinstance(value, torch.Tensor) and value.dim() > 1:
                joined = pad_cat([r[key] for r in results], PADDING.get(key, 0))
                sizes = [r[key].shape[0] for r in results]
                for r, part in zip(results, joined.split(sizes)):
                    r[key] = part
    return collect_results("merge", results)
