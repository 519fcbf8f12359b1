"""Knowledge distillation."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from twinkle.loss.base import Loss, LossContext, register_loss
from twinkle.loss.head import HeadNeeds


@register_loss
class GKDLoss(Loss):
    """Generalised knowledge distillation against a teacher's top-k log-probs.

    Inputs per token: `teacher_topk_ids` [B, T, K] and `teacher_topk_logprobs` [B, T, K]. Both
    distributions are restricted to the teacher's top-k ids and renormalised there:
        P_t = softmax(teacher_topk_logprobs_t / τ),  Q_t = softmax(student log p at those ids / τ)
        β = 0: D_t = KL(P_t ‖ Q_t)        β = 1: D_t = KL(Q_t ‖ P_t)
        else:  M_t = β·P_t + (1−β)·Q_t,   D_t = β·KL(P_t ‖ M_t) + (1−β)·KL(Q_t ‖ M_t)
        L = Σ_t m_t · D_t
    """

    aliases = ("gkd",)
    required_fields = ("teacher_topk_ids", "teacher_topk_logprobs")

    def __init__(self, beta: float = 0.5, temperature: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"GKD beta must lie in [0, 1], got {beta}")
        self.beta, self.temperature = beta, temperature

    def head_needs(self, ctx: LossContext) -> HeadNeeds:
        return HeadNeeds(index_B_T_K=ctx.fields.get("teacher_topk_ids"))

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        ids = ctx.fields["teacher_topk_ids"]
        teacher = F.log_softmax(ctx.fields["teacher_topk_logprobs"].float() / self.temperature, dim=-1)
        student = F.log_softmax(ctx.head.logps_at(ids) / self.temperature, dim=-1)

        def kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
            return (log_a.exp() * (log_a - log_b)).sum(-1)

        if self.beta == 0:
            return kl(teacher, student)
        if self.beta == 1:
            return kl(student, teacher)
        log_mix = torch.logsumexp(
            torch.stack(
                [teacher + torch.log(torch.tensor(self.beta)), student + torch.log(torch.tensor(1 - self.beta))]
            ),
            dim=0,
        )
        return self.beta * kl(teacher, log_mix) + (1 - self.beta) * kl(student, log_mix)
