"""Supervised losses."""

from __future__ import annotations

from twinkle.loss.base import Loss, LossContext, register_loss


@register_loss
class CrossEntropyLoss(Loss):
    """Token-level (optionally weighted) negative log-likelihood.

        L = -Σ_t m_t · w_t · log p_θ(x_t)   [/ Σ_t m_t when reduction='mean']

    m_t = 1 where the label is not -100; w_t is the optional float input `weights` (per token or
    per row, default 1, any sign: Tinker's custom losses send -dC/dlogp as weights).
    """

    aliases = ("cross_entropy", "ce")

    def per_token(self, ctx: LossContext):
        return -ctx.token_field("weights", 1.0) * ctx.logps_B_T
