"""Per-token generalised advantage estimation (twinkle-kit's `GAEAdvantage`), for PPO with a value model.

Over a row's completion tokens t_1 < t_2 < ... < t_L (the positions its mask keeps, in order; a masked
position between two of them, a tool's output say, is skipped, not counted as a step):

    δ_k = r_k + γ·V_{k+1} − V_k          (V_{L+1} = 0: the completion ends there)
    A_k = δ_k + γ·λ·A_{k+1}              (A_{L+1} = 0)
    R_k = A_k + V_k                      (the value model's regression target)

λ = 1 gives A_k = Σ_j γ^(j−k)·r_j − V_k (discounted returns minus values), λ = 0 the TD errors δ_k.
`normalize` whitens A over every kept token of the batch (population std, +1e-8) when there is more
than one; R is taken before that. Both are 0 off the mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from twinkle.advantage.base import Advantage, register_advantage

WHITEN_EPS = 1e-8


def _rows(values, name: str) -> torch.Tensor:
    """[B, T] float32 from a tensor, a list of numbers (one row) or a list of lists (ragged rows are
    right-padded with 0; their missing positions are masked by `_padded_mask`)."""
    if isinstance(values, torch.Tensor):
        out = values.detach().to(torch.float32)
    elif values and isinstance(values[0], Sequence):
        width = max(len(v) for v in values)
        out = torch.zeros(len(values), width)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.as_tensor(v, dtype=torch.float32)
    else:
        out = torch.as_tensor(values, dtype=torch.float32)
    out = out.unsqueeze(0) if out.dim() == 1 else out
    if out.dim() != 2:
        raise ValueError(f"{name} must be per token, [B, T] (or [T]); got shape {tuple(out.shape)}")
    return out


def _padded_mask(values, shape: torch.Size) -> torch.Tensor:
    """True where a (possibly ragged) list of rows had an entry."""
    mask = torch.ones(shape, dtype=torch.bool)
    if not isinstance(values, torch.Tensor) and values and isinstance(values[0], Sequence):
        for i, v in enumerate(values):
            mask[i, len(v) :] = False
    return mask


def gae(
    rewards_B_T: torch.Tensor, values_B_T: torch.Tensor, mask_B_T: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """Raw (unwhitened) advantages over each row's kept positions, 0 elsewhere. The kept positions are
    packed to the left first, so one backward sweep over the longest completion serves every row."""
    B = rewards_B_T.shape[0]
    order_B_T = torch.argsort((~mask_B_T).to(torch.int8), dim=1, stable=True)  # kept positions first, in order
    kept_B_T = mask_B_T.gather(1, order_B_T)
    r_B_T, v_B_T = rewards_B_T.gather(1, order_B_T), values_B_T.gather(1, order_B_T)
    next_v_B_T = torch.cat([v_B_T[:, 1:], v_B_T.new_zeros(B, 1)], dim=1)
    next_kept_B_T = torch.cat([kept_B_T[:, 1:], kept_B_T.new_zeros(B, 1)], dim=1)
    delta_B_T = r_B_T + gamma * next_v_B_T * next_kept_B_T - v_B_T
    packed_B_T = torch.zeros_like(delta_B_T)
    running_B = delta_B_T.new_zeros(B)
    longest = int(mask_B_T.sum(1).max()) if mask_B_T.numel() else 0
    for k in range(longest - 1, -1, -1):
        running_B = torch.where(kept_B_T[:, k], delta_B_T[:, k] + gamma * lam * running_B, 0.0)
        packed_B_T[:, k] = running_B
    return torch.zeros_like(packed_B_T).scatter(1, order_B_T, packed_B_T)


@register_advantage
class GAEAdvantage(Advantage):
    """Token-level GAE over a value model's per-token values: `(advantages, returns)`, both [B, T]."""

    aliases = ("gae",)

    def __init__(self, gamma: float = 1.0, gae_lambda: float = 0.95, normalize: bool = True):
        if not 0.0 <= gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {gamma}")
        if not 0.0 <= gae_lambda <= 1.0:
            raise ValueError(f"gae_lambda must be in [0, 1], got {gae_lambda}")
        self.gamma, self.gae_lambda, self.normalize = float(gamma), float(gae_lambda), bool(normalize)

    def __call__(  # ty: ignore[incompatible-method-override] - twinkle-kit's per-token signature, not per sample
        self, rewards, values, *, masks=None, normalize: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rewards_B_T, values_B_T = _rows(rewards, "rewards"), _rows(values, "values")
        if rewards_B_T.shape != values_B_T.shape:
            raise ValueError(
                f"rewards and values must have the same shape, got {tuple(rewards_B_T.shape)} and "
                f"{tuple(values_B_T.shape)}"
            )
        mask_B_T = _padded_mask(rewards, rewards_B_T.shape) & _padded_mask(values, values_B_T.shape)
        if masks is not None:
            given_B_T = _rows(masks, "masks").bool()
            if given_B_T.shape != rewards_B_T.shape:
                raise ValueError(f"masks has shape {tuple(given_B_T.shape)}; rewards {tuple(rewards_B_T.shape)}")
            mask_B_T &= given_B_T
        adv_B_T = gae(rewards_B_T, values_B_T, mask_B_T, self.gamma, self.gae_lambda)
        returns_B_T = torch.where(mask_B_T, adv_B_T + values_B_T, 0.0)
        kept = adv_B_T[mask_B_T]
        if (self.normalize if normalize is None else normalize) and kept.numel() > 1:
            whitened_B_T = (adv_B_T - kept.mean()) / (kept.std(unbiased=False) + WHITEN_EPS)
            adv_B_T = torch.where(mask_B_T, whitened_B_T, 0.0)
        return adv_B_T, returns_B_T

    def compute(self, rewards_N, index_N, valid_N):  # noqa: ARG002 - Advantage.compute's signature
        raise TypeError("GAEAdvantage is per token: call it as GAEAdvantage()(rewards_B_T, values_B_T, masks=...)")

    @staticmethod
    def build_token_rewards(
        rewards, lengths: Sequence[int], *, old_logps=None, ref_logps=None, kl_coef: float = 0.0
    ) -> list[list[float]]:
        """Per-token rewards of completions `lengths` long: each sequence's reward on its last token,
        plus −kl_coef·(old_logp − ref_logp) on every token when both log-prob lists are given."""
        if not isinstance(rewards, torch.Tensor):
            rewards = [float(r) for r in rewards]  # a list, or a RewardResult (read as its totals)
        totals = torch.as_tensor(rewards, dtype=torch.float32).flatten().tolist()
        if len(totals) != len(lengths):
            raise ValueError(f"{len(totals)} rewards for {len(lengths)} completion lengths")
        if (old_logps is None) != (ref_logps is None):
            raise ValueError("old_logps and ref_logps go together (the KL penalty needs both)")
        out = []
        for i, (reward, n) in enumerate(zip(totals, lengths)):
            if n <= 0:
                raise ValueError(f"completion {i} has length {n}; lengths must be positive")
            row = [0.0] * n
            if old_logps is not None and ref_logps is not None:
                old, ref = list(old_logps[i]), list(ref_logps[i])
                if len(old) != n or len(ref) != n:
                    raise ValueError(f"completion {i}: {len(old)} old and {len(ref)} ref log-probs for {n} tokens")
                row = [-kl_coef * (float(o) - float(r)) for o, r in zip(old, ref)]
            row[-1] += float(reward)
            out.append(row)
        return out
