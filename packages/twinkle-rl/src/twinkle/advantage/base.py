"""The Advantage extension point: rewards of N samples in groups -> N advantages.

Groups are given as `group_size` (contiguous runs of that many samples: the `num_samples`
completions of each prompt) or `group_ids` (any hashable per sample); neither means one group.
`valid` masks samples out (failed rewards, NaN): they take no part in any statistic and get
advantage 0, so they contribute no gradient.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import ClassVar

import torch

from twinkle.registry import Registry


def group_index(n: int, group_size: int | None = None, group_ids: Sequence[Hashable] | None = None) -> torch.Tensor:
    """Group number (0..G-1) of each of `n` samples."""
    if group_size is not None and group_ids is not None:
        raise ValueError("give group_size or group_ids, not both")
    if group_ids is not None:
        if len(group_ids) != n:
            raise ValueError(f"{len(group_ids)} group_ids for {n} rewards")
        first_seen: dict = {}
        return torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in group_ids], dtype=torch.long)
    if group_size is None:
        return torch.zeros(n, dtype=torch.long)
    if not isinstance(group_size, int) or group_size < 1 or n % group_size:
        raise ValueError(f"group_size must be a positive int dividing the {n} rewards, got {group_size!r}")
    return torch.arange(n) // group_size


def group_sum(values_N: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """Per-sample sum of its group's values ([N] -> [N])."""
    sums_G = torch.zeros(int(index_N.max()) + 1 if len(index_N) else 0, dtype=values_N.dtype)
    return sums_G.index_add_(0, index_N, values_N)[index_N]


class Advantage:
    """Base class. Subclasses implement `compute(rewards_N, index_N, valid_N) -> advantages_N`
    (rewards at invalid positions are already zeroed; the result there is zeroed again)."""

    aliases: ClassVar[tuple[str, ...]] = ()

    def with_scale(self, scale: str) -> Advantage:
        """This estimator normalising by `scale` (GRPOAdvantage's scale_by); others have no scale."""
        raise ValueError(f"{type(self).__name__} takes no scale (scale={scale!r}): GRPOAdvantage does")

    def __call__(
        self,
        rewards,
        group_size: int | None = None,
        group_ids: Sequence[Hashable] | None = None,
        valid=None,
        *,
        num_generations: int | None = None,
        scale: str | None = None,
    ) -> torch.Tensor:
        """twinkle-kit's keywords: `num_generations` is `group_size`; `scale` ('group' / 'batch' /
        'none') is GRPOAdvantage's `scale_by`, for this call."""
        if num_generations is not None:
            if group_size is not None and group_size != num_generations:
                raise ValueError(f"group_size={group_size} and num_generations={num_generations} disagree")
            group_size = num_generations
        if scale is not None:
            return self.with_scale(scale)(rewards, group_size, group_ids, valid)
        rewards_N = torch.as_tensor(getattr(rewards, "values", rewards), dtype=torch.float64).flatten()
        if valid is None and hasattr(rewards, "valid"):
            valid = rewards.valid  # a RewardResult: its failed samples drop out
        valid_N = torch.isfinite(rewards_N)
        if valid is not None:
            valid_N &= torch.as_tensor(valid, dtype=torch.bool).flatten()
            if valid_N.shape != rewards_N.shape:
                raise ValueError(f"valid has {valid_N.numel()} entries for {rewards_N.numel()} rewards")
        index_N = group_index(rewards_N.numel(), group_size, group_ids)
        rewards_N = torch.where(valid_N, rewards_N, torch.zeros_like(rewards_N))
        adv_N = self.compute(rewards_N, index_N, valid_N)
        return torch.where(valid_N, adv_N, torch.zeros_like(adv_N)).to(torch.float32)

    def compute(self, rewards_N: torch.Tensor, index_N: torch.Tensor, valid_N: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # What an estimator carries across batches (a running baseline), as plain JSON, so an RL
    # checkpoint resumes it (twinkle.rl.checkpoint). Stateless by default.
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got {sorted(state)}")


ADVANTAGES: Registry[Advantage] = Registry("advantage", "twinkle.advantage", Advantage)
register_advantage = ADVANTAGES.register


def create_advantage(name_or_cls, **kwargs) -> Advantage:
    return ADVANTAGES.create(name_or_cls, **kwargs)
