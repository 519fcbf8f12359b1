"""Preference losses. The batch holds pairs: rows 2k (chosen) and 2k+1 (rejected).

Sequence log-prob: S(y) = Σ_t m_t · log p(x_t). Losses are averaged over pairs
(`reduction='sum'`: summed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkle.loss.base import Loss, LossContext, LossOutput, register_loss


def _pairs(values_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if values_B.shape[0] % 2:
        raise ValueError(
            f"preference losses need an even batch of (chosen, rejected) rows, got {values_B.shape[0]} rows"
        )
    return values_B[0::2], values_B[1::2]


class PairLoss(Loss):
    unit = "pair"  # averaged over (chosen, rejected) pairs, not tokens

    def _finish(
        self, losses_P: torch.Tensor, chosen_reward_P: torch.Tensor, rejected_reward_P: torch.Tensor
    ) -> LossOutput:
        loss = losses_P.sum() if self.reduction == "sum" else losses_P.mean()
        return LossOutput(
            loss,
            {
                "reward_accuracy": (chosen_reward_P > rejected_reward_P).float().mean().item(),
                "reward_margin": (chosen_reward_P - rejected_reward_P).mean().item(),
            },
        )


@register_loss
class DPOLoss(PairLoss):
    """Direct preference optimisation against a reference policy.

        h = [S_θ(y_c) − S_ref(y_c)] − [S_θ(y_r) − S_ref(y_r)]
        sigmoid: L = −(1−ε)·log σ(β·h) − ε·log σ(−β·h)     (ε = label_smoothing)
        ipo:     L = (h − 1/(2β))²
        hinge:   L = max(0, 1 − β·h)

    The reference is the `ref_logprobs` input if given, else the same base model with the adapter
    disabled (computed by the model without gradient). `reference_free=True` drops it (S_ref = 0).
    `sft_weight` w adds w · NLL(y_c), the chosen reply's mean negative log-likelihood per token
    (twinkle-kit's keywords, both).
    """

    aliases = ("dpo",)
    LOSS_TYPES = ("sigmoid", "ipo", "hinge")

    def __init__(
        self,
        beta: float = 0.1,
        loss_type: str = "sigmoid",
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        *,
        reference_free: bool = False,
        sft_weight: float = 0.0,
    ) -> None:
        super().__init__(reduction)
        if loss_type not in self.LOSS_TYPES:
            raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {self.LOSS_TYPES}")
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing
        self.reference_free, self.sft_weight = reference_free, sft_weight

    def needs_reference(self, fields: dict) -> bool:
        return not self.reference_free and "ref_logprobs" not in fields

    def compute(self, ctx: LossContext) -> LossOutput:
        mask = ctx.mask_B_T
        policy_c, policy_r = _pairs((ctx.logps_B_T * mask).sum(1))
        if self.reference_free:
            ref_c, ref_r = torch.zeros_like(policy_c), torch.zeros_like(policy_r)
        else:
            ref_c, ref_r = _pairs((ctx.ref_logps().detach() * mask).sum(1))
        h = (policy_c - ref_c) - (policy_r - ref_r)
        if self.loss_type == "sigmoid":
            losses = -(1 - self.label_smoothing) * F.logsigmoid(self.beta * h) - self.label_smoothing * F.logsigmoid(
                -self.beta * h
            )
        elif self.loss_type == "ipo":
            losses = (h - 1 / (2 * self.beta)) ** 2
        else:
            losses = torch.relu(1 - self.beta * h)
        if self.sft_weight:
            tokens_c, _ = _pairs(mask.sum(1))
            losses = losses + self.sft_weight * (-policy_c / tokens_c.clamp(min=1))
        chosen, rejected = self.beta * (policy_c - ref_c).detach(), self.beta * (policy_r - ref_r).detach()
        out = self._finish(losses, chosen, rejected)
        out.metrics.update(
            reward_chosen=chosen.mean().item(),
            reward_rejected=rejected.mean().item(),
            logps_chosen=policy_c.detach().mean().item(),
            logps_rejected=policy_r.detach().mean().item(),
        )
        return out


@register_loss
class SimPOLoss(PairLoss):
    """Simple preference optimisation (reference-free, length-normalised).

    a(y) = S_θ(y) / Σ_t m_t                  (mean token log-prob)
    L    = −log σ(β·(a(y_c) − a(y_r)) − γ)
    """

    aliases = ("simpo",)

    def __init__(self, beta: float = 2.0, gamma: float = 0.5, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.beta, self.gamma = beta, gamma

    def compute(self, ctx: LossContext) -> LossOutput:
        mask = ctx.mask_B_T
        avg_B = (ctx.logps_B_T * mask).sum(1) / mask.sum(1).clamp(min=1)
        chosen, rejected = _pairs(avg_B)
        losses = -F.logsigmoid(self.beta * (chosen - rejected) - self.gamma)
        return self._finish(losses, self.beta * chosen.detach(), self.beta * rejected.detach())
