"""StableReinforce (Tinker's `stable_reinforce`): REINFORCE with a truncated, detached importance weight.

Tinker documents the loss's contract (sample with `record_stability_info`, name each training
position's sampled sequence with provenance spans, the objective "stays stable when the sampling
policy differs from the policy being trained") but not its formula. Ours is truncated importance
sampling (TIS), written so that its value reads like `importance_sampling`:

    r_t = exp(log p_θ(x_t) − log q(x_t))            q: the sampler's recorded log-prob of x_t
    w_t = min(r_t, C)                               C = `ratio_cap` (default 2.0)
    L   = −Σ_t s_t · m_t · r_t · sg(w_t / r_t) · A_t

so L's value is −Σ s·m·min(r, C)·A and its gradient −Σ s·m·min(r, C)·A·∇log p_θ: every sampled token's
REINFORCE gradient, weighted by how much more likely the learner finds it than the sampler did, but
never by more than C (an untruncated ratio is what blows up when sampler and learner numerics or
weights drift apart). s_t is the input `sampled_mask` (1 where the target is a sampled token, 0 on
prompt positions: they were not sampled, so they carry no policy gradient); the optional input `mask`
(the cookbook's parse-error mask) multiplies it. On policy (r = 1) the loss is −Σ s·m·A and its gradient
is plain REINFORCE's.

The server (twinkle.serve.tinker.provenance) fills `logprobs` and `sampled_mask` from what it recorded
at sampling time; a datum's own `logprobs` are not trusted.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.loss.base import Loss, LossContext, LossOutput, register_loss, token_field


def _weight(fields: Mapping[str, torch.Tensor], mask_B_T: torch.Tensor) -> torch.Tensor:
    """The loss tokens that carry a policy gradient: the sampled ones, less the parse-error mask."""
    return mask_B_T * token_field(fields, "sampled_mask", mask_B_T, 1.0) * token_field(fields, "mask", mask_B_T, 1.0)


@register_loss
class StableReinforceLoss(Loss):
    """L = −Σ_t s_t · m_t · r_t · sg(min(r_t, C) / r_t) · A_t  (value −Σ s·m·min(r, C)·A)."""

    aliases = ("stable_reinforce",)
    required_fields = ("advantages", "logprobs")

    def __init__(self, ratio_cap: float = 2.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        if not ratio_cap >= 1.0:  # also refuses NaN
            raise ValueError(f"ratio_cap must be >= 1 (1 is on-policy REINFORCE), got {ratio_cap}")
        self.ratio_cap = float(ratio_cap)

    def units(self, targets_B_T: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> float:
        """Its mean divides by the weighted loss tokens (`sampled_mask` x `mask`), as `compute` does."""
        mask_B_T = (targets_B_T != IGNORE_INDEX).float()
        return float(_weight(fields, mask_B_T).sum())

    def compute(self, ctx: LossContext) -> LossOutput:
        logp = ctx.logps_B_T
        ratio = torch.exp(logp - ctx.token_field("logprobs"))
        # min(r, C) / r, detached: 1 below the cap, C / r above it (r > 0 always: an exp)
        scale = (ratio.clamp(max=self.ratio_cap) / ratio).detach()
        weight = _weight(ctx.fields, ctx.mask_B_T)
        per_tok = -ratio * scale * ctx.token_field("advantages")
        n = weight.sum().clamp(min=1.0)
        truncated = ((ratio.detach() > self.ratio_cap).float() * weight).sum() / n
        return LossOutput(self.reduce(per_tok, weight), {"truncated_fraction": truncated.item()})
