"""GRPO, RLOO and REINFORCE advantages."""

from __future__ import annotations

import torch

from twinkle.advantage.base import Advantage, group_sum, register_advantage


def _group_mean_std(rewards_N, index_N, valid_N):
    """Mean and sample standard deviation (n−1) of each sample's group over its valid members."""
    w = valid_N.to(rewards_N.dtype)
    count_N = group_sum(w, index_N)
    mean_N = group_sum(rewards_N * w, index_N) / count_N.clamp(min=1)
    sq_N = group_sum((rewards_N - mean_N) ** 2 * w, index_N)
    std_N = torch.sqrt(sq_N / (count_N - 1).clamp(min=1))
    return mean_N, std_N, count_N


@register_advantage
class GRPOAdvantage(Advantage):
    """A_i = (r_i − mean_g) / (std + eps), mean over the sample's group g.

    `scale_by='group'`: std of the group (GRPO); `'batch'`: std of every valid reward in the batch;
    `'none'`: no division (Dr. GRPO). Standard deviations are sample (n−1) ones; a group whose
    rewards are all equal gets advantage 0 everywhere.
    """

    aliases = ("grpo",)

    def __init__(self, scale_by: str = "group", eps: float = 1e-6):
        if scale_by not in ("group", "batch", "none"):
            raise ValueError(f"scale_by must be 'group', 'batch' or 'none', got {scale_by!r}")
        self.scale_by, self.eps = scale_by, eps

    def with_scale(self, scale: str) -> GRPOAdvantage:
        return GRPOAdvantage(scale_by=scale, eps=self.eps)

    def compute(self, rewards_N, index_N, valid_N):
        mean_N, std_N, _ = _group_mean_std(rewards_N, index_N, valid_N)
        centred_N = rewards_N - mean_N
        if self.scale_by == "none":
            return centred_N
        if self.scale_by == "batch":
            _, std_N, _ = _group_mean_std(rewards_N, torch.zeros_like(index_N), valid_N)
        return centred_N / (std_N + self.eps)


@register_advantage
class RLOOAdvantage(Advantage):
    """Leave-one-out baseline: A_i = r_i − mean_{j ∈ g, j ≠ i} r_j  (0 for a group of one)."""

    aliases = ("rloo",)

    def compute(self, rewards_N, index_N, valid_N):
        w = valid_N.to(rewards_N.dtype)
        count_N = group_sum(w, index_N)
        others_N = (group_sum(rewards_N * w, index_N) - rewards_N) / (count_N - 1).clamp(min=1)
        return torch.where(count_N > 1, rewards_N - others_N, torch.zeros_like(rewards_N))


@register_advantage
class REINFORCEAdvantage(Advantage):
    """A_i = r_i − b. `baseline='batch'`: b = mean valid reward of this batch; `'ema'`: a running
    mean over past batches (b starts at the first batch's mean, then b ← m·b + (1−m)·batch mean,
    updated after use); `'none'`: b = 0 (plain REINFORCE). Groups are ignored."""

    aliases = ("reinforce",)

    def __init__(self, baseline: str = "batch", momentum: float = 0.9):
        if baseline not in ("batch", "ema", "none"):
            raise ValueError(f"baseline must be 'batch', 'ema' or 'none', got {baseline!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.baseline_kind, self.momentum = baseline, momentum
        self.baseline: float | None = None

    def state_dict(self) -> dict:
        return {"baseline": self.baseline}

    def load_state_dict(self, state: dict) -> None:
        self.baseline = state.get("baseline")

    # ARG002: Advantage.compute's signature; REINFORCE needs no groups
    def compute(self, rewards_N, index_N, valid_N):  # noqa: ARG002
        if self.baseline_kind == "none":
            return rewards_N.clone()
        n = int(valid_N.sum())
        batch_mean = float(rewards_N[valid_N].mean()) if n else 0.0
        if self.baseline_kind == "batch":
            return rewards_N - batch_mean
        b = batch_mean if self.baseline is None else self.baseline
        if n:
            self.baseline = (
                batch_mean if self.baseline is None else self.momentum * b + (1 - self.momentum) * batch_mean
            )
        return rewards_N - b
