"""RL step metrics computed from tensors the loop already has.

Token tensors are [B, T] with a float/bool `mask_B_T` (1 where the token is a trained completion
token); every mean is over masked tokens of the whole batch. Log-probs are natural logs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _masked_mean(values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    mask = mask_B_T.to(values_B_T.dtype)
    return float((values_B_T * mask).sum() / mask.sum().clamp(min=1))


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and population std; (nan, nan) for no values."""
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def reward_metrics(result, prefix: str = "reward") -> dict[str, float]:
    """`reward/mean`, `reward/std` over valid samples, the same per component, and `reward/failed`
    (fraction of samples whose scoring raised)."""
    valid = result.valid
    out: dict[str, float] = {}
    out[f"{prefix}/mean"], out[f"{prefix}/std"] = _mean_std([v for v, ok in zip(result.values, valid) if ok])
    for name, values in result.components.items():
        ok_values = [v for v, ok in zip(values, valid) if ok]
        out[f"{prefix}/{name}/mean"], out[f"{prefix}/{name}/std"] = _mean_std(ok_values)
    out[f"{prefix}/failed"] = sum(result.failed) / max(len(result), 1)
    return out


def kl_to_reference(
    logps_B_T: torch.Tensor, ref_logps_B_T: torch.Tensor, mask_B_T: torch.Tensor, estimator: str = "k3"
) -> float:
    """Per-token estimate of KL(π ‖ π_ref) on tokens sampled from π, with d = log π_ref − log π:
    k1 = −d (unbiased, noisy), k2 = d²/2, k3 = e^d − d − 1 (unbiased, ≥ 0; GRPO's)."""
    d = (ref_logps_B_T - logps_B_T).float()
    per_token = {"k1": lambda: -d, "k2": lambda: 0.5 * d**2, "k3": lambda: torch.exp(d) - d - 1}
    if estimator not in per_token:
        raise ValueError(f"estimator must be one of {sorted(per_token)}, got {estimator!r}")
    return _masked_mean(per_token[estimator](), mask_B_T)


def clip_fraction(
    logps_B_T: torch.Tensor,
    old_logps_B_T: torch.Tensor,
    advantages,
    mask_B_T: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
) -> float:
    """Share of tokens where the PPO/GRPO clip is active: r > 1+ε_high with A > 0, or r < 1−ε_low with A < 0."""
    ratio = torch.exp((logps_B_T - old_logps_B_T).float())
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    adv = adv[:, None].expand_as(ratio) if adv.dim() == 1 else adv
    clipped = ((ratio > 1 + eps_high) & (adv > 0)) | ((ratio < 1 - eps_low) & (adv < 0))
    return _masked_mean(clipped.float(), mask_B_T)


def entropy(logits_B_T_V: torch.Tensor, mask_B_T: torch.Tensor) -> float:
    """Mean entropy of the next-token distributions (nats)."""
    logp = F.log_softmax(logits_B_T_V.float(), dim=-1)
    return _masked_mean(-(logp.exp() * logp).sum(-1), mask_B_T)


def sampled_entropy(token_logprobs: list[list[float]]) -> float:
    """Monte-Carlo entropy estimate from sampled tokens' log-probs: −mean log p (nats per token).
    Needs only what the sampler returns (no logits)."""
    flat = [lp for seq in token_logprobs for lp in seq if lp is not None]
    return -sum(flat) / len(flat) if flat else math.nan


def importance_ratio_stats(
    logps_B_T: torch.Tensor, behaviour_logps_B_T: torch.Tensor, mask_B_T: torch.Tensor, prefix: str = "is_ratio"
) -> dict[str, float]:
    """Statistics of w_t = π(x_t)/q(x_t) over masked tokens (q: the policy that sampled):
    mean, std (population), min, max, the effective-sample-size fraction (Σw)²/(n·Σw²), and the
    mean sequence ratio exp(mean_t log w_t) per row."""
    mask = mask_B_T.bool()
    log_w_B_T = (logps_B_T - behaviour_logps_B_T).double()
    w = torch.exp(log_w_B_T[mask])
    if w.numel() == 0:
        return {f"{prefix}/{k}": math.nan for k in ("mean", "std", "min", "max", "ess", "seq_mean")}
    per_row = (log_w_B_T * mask).sum(1) / mask.sum(1).clamp(min=1)
    rows = mask.any(1)
    return {
        f"{prefix}/mean": float(w.mean()),
        f"{prefix}/std": float(w.std(unbiased=False)),
        f"{prefix}/min": float(w.min()),
        f"{prefix}/max": float(w.max()),
        f"{prefix}/ess": float(w.sum() ** 2 / (w.numel() * (w**2).sum())),
        f"{prefix}/seq_mean": float(torch.exp(per_row[rows]).mean()),
    }
