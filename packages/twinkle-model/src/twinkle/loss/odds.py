"""Reference-free preference losses twinkle-kit names: CPO and ORPO. The batch holds (chosen, rejected)
pairs in rows 2k and 2k+1, as for every PairLoss.

    S(y) = Σ_t m_t · log p(x_t)        a(y) = S(y) / Σ_t m_t        NLL(y) = −a(y)

    CPO:  L = −log σ(β · (S(y_c) − S(y_r))) + bc_coef · NLL(y_c)         (Xu et al., 2024)
    ORPO: L = NLL(y_c) − λ · log σ(odds(y_c) − odds(y_r)),
          odds(y) = a(y) − log(1 − exp(a(y)))                          (Hong et al., 2024)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from twinkle.loss.base import LossContext, LossOutput, register_loss
from twinkle.loss.preference import PairLoss


def _chosen_rejected(ctx: LossContext) -> tuple[torch.Tensor, ...]:
    """(S chosen, S rejected, tokens chosen, tokens rejected), each per pair."""
    mask = ctx.mask_B_T
    seq_B, tokens_B = (ctx.logps_B_T * mask).sum(1), mask.sum(1).clamp(min=1)
    if seq_B.shape[0] % 2:
        raise ValueError(f"{seq_B.shape[0]} rows: preference losses need (chosen, rejected) pairs")
    return seq_B[0::2], seq_B[1::2], tokens_B[0::2], tokens_B[1::2]


def _log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0, stable at both ends."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@register_loss
class CPOLoss(PairLoss):
    aliases = ("cpo",)

    def __init__(self, beta: float = 0.1, bc_coef: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.beta, self.bc_coef = beta, bc_coef

    def compute(self, ctx: LossContext) -> LossOutput:
        s_c, s_r, n_c, _ = _chosen_rejected(ctx)
        losses = -F.logsigmoid(self.beta * (s_c - s_r)) + self.bc_coef * (-s_c / n_c)
        return self._finish(losses, self.beta * s_c.detach(), self.beta * s_r.detach())


@register_loss
class ORPOLoss(PairLoss):
    aliases = ("orpo",)

    def __init__(self, lambda_orpo: float = 0.1, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.lambda_orpo = lambda_orpo

    def compute(self, ctx: LossContext) -> LossOutput:
        s_c, s_r, n_c, n_r = _chosen_rejected(ctx)
        a_c, a_r = s_c / n_c, s_r / n_r
        log_odds = (a_c - _log1m_exp(a_c)) - (a_r - _log1m_exp(a_r))
        losses = -a_c - self.lambda_orpo * F.logsigmoid(log_odds)
        return self._finish(losses, a_c.detach(), a_r.detach())
