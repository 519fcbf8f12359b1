"""Value-model losses (twinkle-kit's MSELoss and PPOValueLoss), over a value head's per-token output V_t
(`TokenHead.values()`, aligned with the targets) and the rows' `returns` R_t (per completion token, or
one per row, broadcast), on the loss tokens m_t (targets not -100):

    MSELoss:       ℓ_t = (V_t − R_t)²
    PPOValueLoss:  ℓ_t = ½·max((V_t − R_t)², (V_old + clip(V_t − V_old, −ε, ε) − R_t)²)   (V_old: `old_values`)

    L = Σ m·ℓ / Σ m  ('mean'),  Σ m·ℓ  ('sum')

twinkle-kit's MSELoss reads float targets from `labels` and averages every element, unmasked; ours reads
`returns` and averages the loss tokens, so a prompt's positions never pull the values.
"""

from __future__ import annotations

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.loss.base import Loss, LossContext, LossOutput, register_loss


def _check_ignore_index(ignore_index: int) -> None:
    if ignore_index != IGNORE_INDEX:
        raise ValueError(f"ignore_index={ignore_index}: loss tokens are the targets that are not {IGNORE_INDEX}")


@register_loss
class MSELoss(Loss):
    """Value regression: the squared error of the value head's output against `returns`."""

    aliases = ("mse",)
    required_fields = ("returns",)

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        values_B_T = ctx.head.values().float()
        return (values_B_T - ctx.token_field("returns")) ** 2


@register_loss
class PPOValueLoss(Loss):
    """PPO's clipped value loss: a value may not move more than ε from `old_values` for free."""

    aliases = ("ppo_value",)
    required_fields = ("returns", "old_values")

    def __init__(self, epsilon: float = 0.2, ignore_index: int = IGNORE_INDEX, reduction: str = "mean") -> None:
        super().__init__(reduction)
        _check_ignore_index(ignore_index)
        if not epsilon > 0:
            raise ValueError(f"epsilon must be positive, got {epsilon}")
        self.epsilon = float(epsilon)

    def compute(self, ctx: LossContext) -> LossOutput:
        values_B_T = ctx.head.values().float()
        returns_B_T, old_B_T = ctx.token_field("returns"), ctx.token_field("old_values")
        moved_B_T = values_B_T - old_B_T
        clipped_B_T = old_B_T + moved_B_T.clamp(-self.epsilon, self.epsilon)
        per_token = 0.5 * torch.maximum((values_B_T - returns_B_T) ** 2, (clipped_B_T - returns_B_T) ** 2)
        return LossOutput(
            self.reduce(per_token, ctx.mask_B_T), critic_numbers(values_B_T, returns_B_T, moved_B_T, ctx, self.epsilon)
        )


def critic_numbers(
    values_B_T: torch.Tensor, returns_B_T: torch.Tensor, moved_B_T: torch.Tensor, ctx: LossContext, epsilon: float
) -> dict[str, float]:
    """What PPOValueMetric reports, over the loss tokens: mean value and return, the fraction of values
    clipped, and the variance of the returns the values explain, 1 − Var(R − V) / Var(R)."""
    keep = ctx.mask_B_T.bool()
    if not keep.any():
        return {}
    with torch.no_grad():
        v, r = values_B_T[keep], returns_B_T[keep]
        explained = 1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False).clamp(min=1e-8)
        return {
            "value_mean": float(v.mean()),
            "return_mean": float(r.mean()),
            "value_clip_ratio": float((moved_B_T[keep].abs() > epsilon).float().mean()),
            "explained_variance": float(explained),
        }
