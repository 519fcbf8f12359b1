"""Policy-gradient losses for RL on sampled trajectories.

Inputs (per token, shifted like the targets, or per row): `advantages` A_t and `logprobs` log q(x_t),
the sampler's (behaviour policy's) log-prob of each token. r_t = exp(log p_θ(x_t) − log q(x_t)).
Clip thresholds are ratios (lo, hi), as in Tinker: clip(r, lo, hi).
"""

from __future__ import annotations

import torch

from twinkle.loss.base import Loss, LossContext, LossOutput, register_loss
from twinkle.loss.head import HeadNeeds


def _ratio(ctx: LossContext) -> torch.Tensor:
    return torch.exp(ctx.logps_B_T - ctx.token_field("logprobs"))


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, lo: float, hi: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-min(r·A, clip(r, lo, hi)·A) per token, and whether the clipped branch was taken."""
    unclipped, clipped = ratio * adv, ratio.clamp(lo, hi) * adv
    return -torch.minimum(unclipped, clipped), (clipped < unclipped)


class _ThresholdLoss(Loss):
    required_fields = ("advantages", "logprobs")

    def __init__(
        self, clip_low_threshold: float = 0.8, clip_high_threshold: float = 1.2, reduction: str = "mean"
    ) -> None:
        super().__init__(reduction)
        if not 0 <= clip_low_threshold <= 1 <= clip_high_threshold:
            raise ValueError(
                f"need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                f"{clip_low_threshold}, {clip_high_threshold}"
            )
        self.lo, self.hi = clip_low_threshold, clip_high_threshold


@register_loss
class ImportanceSamplingLoss(Loss):
    """L = -Σ_t m_t · r_t · A_t  (REINFORCE with an importance weight for off-policy samples)."""

    aliases = ("importance_sampling",)
    required_fields = ("advantages", "logprobs")

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        return -_ratio(ctx) * ctx.token_field("advantages")


@register_loss
class PPOLoss(_ThresholdLoss):
    """L = -Σ_t m_t · min(r_t·A_t, clip(r_t, lo, hi)·A_t)."""

    aliases = ("ppo",)

    def compute(self, ctx: LossContext) -> LossOutput:
        per_tok, clipped = _clipped_surrogate(_ratio(ctx), ctx.token_field("advantages"), self.lo, self.hi)
        frac = (clipped.float() * ctx.mask_B_T).sum() / ctx.mask_B_T.sum().clamp(min=1)
        return LossOutput(self.reduce(per_tok, ctx.mask_B_T), {"clip_fraction": frac.item()})


@register_loss
class CISPOLoss(_ThresholdLoss):
    """L = -Σ_t m_t · sg(clip(r_t, lo, hi)) · A_t · log p_θ(x_t)   (sg = stop-gradient)."""

    aliases = ("cispo",)

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        weight = _ratio(ctx).detach().clamp(self.lo, self.hi)
        return -weight * ctx.token_field("advantages") * ctx.logps_B_T


@register_loss
class DROLoss(Loss):
    """L = -Σ_t m_t · [log p_θ(x_t)·A_t − ½·β·(log p_θ(x_t) − log q(x_t))²]."""

    aliases = ("dro",)
    required_fields = ("advantages", "logprobs")

    def __init__(self, beta: float = 0.05, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.beta = beta

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        logp = ctx.logps_B_T
        return -(logp * ctx.token_field("advantages") - 0.5 * self.beta * (logp - ctx.token_field("logprobs")) ** 2)


@register_loss
class GSPOLoss(_ThresholdLoss):
    """Group sequence policy optimisation, token form.

        s_i   = exp( Σ_t M_it (log p_θ − log q) / Σ_t M_it )      (sequence ratio of row i)
        s_it  = sg(s_i) · exp(log p_θ(x_t) − sg(log p_θ(x_t)))     (value s_i, per-token gradient)
        L     = -Σ_t m_t · min(s_it·A_t, clip(s_it, lo, hi)·A_t)

    M = the loss mask times the optional input `sequence_ratio_mask`.
    """

    aliases = ("gspo",)

    def compute(self, ctx: LossContext) -> LossOutput:
        logp = ctx.logps_B_T
        ratio_mask = ctx.mask_B_T * ctx.token_field("sequence_ratio_mask", 1.0)
        log_ratio = (logp - ctx.token_field("logprobs")).detach()
        seq_ratio_B = torch.exp((log_ratio * ratio_mask).sum(1) / ratio_mask.sum(1).clamp(min=1))
        token_ratio = seq_ratio_B[:, None] * torch.exp(logp - logp.detach())
        per_tok, clipped = _clipped_surrogate(token_ratio, ctx.token_field("advantages"), self.lo, self.hi)
        frac = (clipped.float() * ctx.mask_B_T).sum() / ctx.mask_B_T.sum().clamp(min=1)
        return LossOutput(self.reduce(per_tok, ctx.mask_B_T), {"clip_fraction": frac.item()})


@register_loss
class GRPOLoss(Loss):
    """GRPO with asymmetric clipping, a KL penalty to a reference policy and an entropy bonus.

        r_t  = exp(log p_θ(x_t) − log q(x_t))   (q = `logprobs`; if absent, sg(p_θ): on-policy, r_t = 1)
        KL_t = exp(log p_ref − log p_θ) − (log p_ref − log p_θ) − 1                (k3 estimator, ≥ 0)
        L    = Σ_t m_t · [ −min(r_t·A_t, clip(r_t, 1−ε_low, 1+ε_high)·A_t) + β·KL_t − c·H_t ]

    H_t is the entropy of p_θ at position t. The reference comes from `ref_logprobs`, else from the
    model (base with the adapter disabled); it is only needed when β > 0.
    """

    aliases = ("grpo",)
    required_fields = ("advantages",)

    def __init__(
        self,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.28,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        reduction: str = "mean",
        *,
        epsilon: float | None = None,
    ) -> None:
        """`epsilon` (twinkle-kit's keyword) clips symmetrically: epsilon_low = epsilon_high = epsilon."""
        super().__init__(reduction)
        if epsilon is not None:
            if (epsilon_low, epsilon_high) != (0.2, 0.28):
                raise ValueError("GRPOLoss takes epsilon or epsilon_low / epsilon_high, not both")
            epsilon_low = epsilon_high = epsilon
        self.epsilon_low, self.epsilon_high, self.beta, self.entropy_coef = (
            epsilon_low,
            epsilon_high,
            beta,
            entropy_coef,
        )

    def needs_reference(self, fields: dict) -> bool:
        return self.beta > 0 and "ref_logprobs" not in fields

    def head_needs(self, ctx: LossContext) -> HeadNeeds:  # noqa: ARG002 - Loss.head_needs' signature
        return HeadNeeds(entropy=bool(self.entropy_coef))

    def surrogate(self, ratio_B_T: torch.Tensor, adv_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The per-token policy term and where it clipped (None: a loss that never clips); a variant
        that shapes the ratio otherwise overrides this, the KL and entropy terms stay."""
        return _clipped_surrogate(ratio_B_T, adv_B_T, 1 - self.epsilon_low, 1 + self.epsilon_high)

    def compute(self, ctx: LossContext) -> LossOutput:
        logp, mask = ctx.logps_B_T, ctx.mask_B_T
        old = ctx.token_field("logprobs") if ctx.has("logprobs") else logp.detach()
        per_tok, clipped = self.surrogate(torch.exp(logp - old), ctx.token_field("advantages"))
        n = mask.sum().clamp(min=1)
        metrics = {} if clipped is None else {"clip_fraction": ((clipped.float() * mask).sum() / n).item()}
        if self.beta > 0:
            delta = ctx.ref_logps() - logp
            kl = torch.exp(delta) - delta - 1
            per_tok = per_tok + self.beta * kl
            metrics["kl"] = ((kl * mask).sum() / n).item()
        if self.entropy_coef:
            entropy = ctx.head.entropy()
            per_tok = per_tok - self.entropy_coef * entropy
            metrics["entropy"] = ((entropy * mask).sum() / n).item()
        return LossOutput(self.reduce(per_tok, mask), metrics)
