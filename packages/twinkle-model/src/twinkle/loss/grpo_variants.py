"""The GRPO variants twinkle-kit names (BNPOLoss, DRGRPOLoss, SAPOLoss), on our GRPOLoss: the same
ratio r_t = exp(log p_θ(x_t) − log q(x_t)) (r_t = 1 without `logprobs`), the same optional β·KL_t to the
reference and −c·H_t entropy bonus, with twinkle-kit's keywords and defaults (`epsilon` clips both sides
unless `epsilon_high` is given). They differ in the policy term ℓ_t or in how ℓ is averaged:

    BNPO:    ℓ_t = −min(r_t·A_t, clip(r_t, 1−ε, 1+ε_high)·A_t),   L = Σ_b Σ_t m·ℓ / Σ_b Σ_t m
    DR-GRPO: the same ℓ_t,                                        L = Σ_b Σ_t m·ℓ / (B · max_completion_length)
    SAPO:    ℓ_t = −g_τ(r_t)·A_t,  g_τ(r) = σ(τ·(r − 1))·4/τ,      L = (1/B) Σ_b (Σ_t m·ℓ / Σ_t m)
             τ = tau_pos where A_t > 0, else tau_neg

B counts the rows that have a loss token. SAPO's gate is smooth where PPO clips: g_τ(1) = 2/τ and
g_τ'(1) = 1, so on policy its gradient is the plain policy gradient A·∇log p, and it fades (never stops)
as r leaves 1; it has no clip range, so `epsilon` / `epsilon_high` (kept for twinkle-kit's signature)
change nothing there. `reduction='sum'` drops the final division (DR-GRPO: by B, not the length).
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle.loss.base import register_loss
from twinkle.loss.policy import GRPOLoss


class _KitGRPO(GRPOLoss):
    """GRPOLoss under twinkle-kit's keywords: `epsilon` for both sides, `epsilon_high` overriding the upper."""

    def __init__(
        self,
        epsilon: float = 0.2,
        epsilon_high: float | None = None,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        reduction: str = "mean",
    ) -> None:
        upper = epsilon if epsilon_high is None else epsilon_high
        super().__init__(
            epsilon_low=epsilon, epsilon_high=upper, beta=beta, entropy_coef=entropy_coef, reduction=reduction
        )


@register_loss
class BNPOLoss(_KitGRPO):
    """Batch-normalised: the clipped surrogate averaged over every loss token of the batch."""

    aliases = ("bnpo",)


@register_loss
class DRGRPOLoss(_KitGRPO):
    """GRPO done right: summed per-token terms over B rows of a fixed length, so a long reply's tokens
    weigh no less than a short one's."""

    aliases = ("dr_grpo",)
    unit = "sequence"

    def __init__(self, epsilon: float = 0.2, beta: float = 0.0, max_completion_length: int = 1024, **kit: Any) -> None:
        super().__init__(epsilon=epsilon, beta=beta, **kit)
        if isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int):
            raise TypeError(f"max_completion_length must be an int, got {max_completion_length!r}")
        if max_completion_length < 1:
            raise ValueError(f"max_completion_length must be positive, got {max_completion_length}")
        self.max_completion_length = max_completion_length

    def reduce(self, values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        total = (values_B_T * mask_B_T).sum() / self.max_completion_length
        return total if self.reduction == "sum" else total / _scored_rows(mask_B_T)


@register_loss
class SAPOLoss(_KitGRPO):
    """Soft adaptive policy optimisation: a sigmoid gate on the ratio instead of a clip, per-row means."""

    aliases = ("sapo",)
    unit = "sequence"

    def __init__(
        self, epsilon: float = 0.2, beta: float = 0.0, tau_pos: float = 1.0, tau_neg: float = 1.0, **kit: Any
    ) -> None:
        super().__init__(epsilon=epsilon, beta=beta, **kit)
        if not (tau_pos > 0 and tau_neg > 0):  # also refuses NaN
            raise ValueError(f"SAPO temperatures must be positive, got tau_pos={tau_pos}, tau_neg={tau_neg}")
        self.tau_pos, self.tau_neg = float(tau_pos), float(tau_neg)

    def surrogate(self, ratio_B_T: torch.Tensor, adv_B_T: torch.Tensor) -> tuple[torch.Tensor, None]:
        tau_B_T = torch.where(adv_B_T > 0, self.tau_pos, self.tau_neg)
        gate_B_T = torch.sigmoid(tau_B_T * (ratio_B_T - 1)) * (4.0 / tau_B_T)
        return -gate_B_T * adv_B_T, None

    def reduce(self, values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        row_means_B = (values_B_T * mask_B_T).sum(1) / mask_B_T.sum(1).clamp(min=1.0)
        total = row_means_B.sum()
        return total if self.reduction == "sum" else total / _scored_rows(mask_B_T)


def _scored_rows(mask_B_T: torch.Tensor) -> torch.Tensor:
    """The rows with a loss token (a 'sequence' loss's units: `Loss.units`), at least 1."""
    return (mask_B_T.sum(1) > 0).sum().clamp(min=1).to(mask_B_T.dtype)
