"""Supervised losses."""

from __future__ import annotations

import torch

from twinkle.loss.base import Loss, LossContext, register_loss


@register_loss
class CrossEntropyLoss(Loss):
    """Token-level (optionally weighted) negative log-likelihood.

        L = -Σ_t m_t · w_t · log p_θ(x_t)   [/ Σ_t m_t when reduction='mean']

    m_t = 1 where the label is not -100; w_t is the optional float input `weights` (per token or
    per row, default 1, any sign: Tinker's custom losses send -dC/dlogp as weights).
    With an input `target_ids` [B, T, K] (K ids per position: a teacher's top-K, a choice's K
    options) each position scores those ids instead of its label, weighted by `weights` [B, T, K]:

        L = -Σ_t m_t · Σ_k w_tk · log p_θ(id_tk)
    """

    aliases = ("cross_entropy", "ce")

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        if "target_ids" not in ctx.fields:
            return -ctx.token_field("weights", 1.0) * ctx.logps_B_T
        logps_B_T_K = ctx.scored_logps()
        weights_B_T_K = ctx.fields.get("weights")
        if weights_B_T_K is None:
            weights_B_T_K = torch.ones_like(logps_B_T_K)
        elif weights_B_T_K.shape != logps_B_T_K.shape:
            raise ValueError(
                f"weights have shape {tuple(weights_B_T_K.shape)}; with target_ids they need its shape "
                f"{tuple(logps_B_T_K.shape)}"
            )
        return -(weights_B_T_K.to(logps_B_T_K.dtype) * logps_B_T_K).sum(-1)
