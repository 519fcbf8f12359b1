"""twinkle-kit's standalone use of GRPOMetric: a GRPO loop hands it each mini-batch's rows, the training
pass's `logps`, the sampler's log-probs and the advantages (`metrics.accumulate(inputs, outputs,
old_logps=, advantages=)`), then reads the policy's drift from the sampling policy (`metrics.calculate()`).

Over the completion tokens of every row accumulated since the last `calculate`:
`train/mean_new_logp` (and `train/policy_confidence`, its exp), `train/mean_old_logp`,
`train/logp_diff_mean` (new - old), `train/approx_kl` (Schulman's k3 estimate of KL(old || new):
exp(d) - d - 1 with d = new - old), `train/token_kl_max`, `train/token_ratio_max`, and the PPO clip rates
gated by the advantage's sign (`train/clip_ratio_low`: ratio < 1 - epsilon where A < 0; `_high`: ratio >
1 + epsilon where A > 0; `train/clip_ratio` both). The old-policy keys need `old_logps`, the clip rates
`advantages`. twinkle-kit's entropy and high-KL records are not produced (our passes return no entropies).

Alignment: `logps` (kit_outputs.row_logps) holds at position t the log-prob of token t + 1, so a row's
completion tokens are the positions t with labels[t + 1] != -100, the labels as the row carries them
(new_input_feature's); `old_logps[i]` (one float per completion token, in order) fill those positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from twinkle.data_format.labels import IGNORE_INDEX


class RolloutLogps:
    """Token sums over the rows accumulated so far (one GRPOMetric's, reset by its `calculate`)."""

    def __init__(self, epsilon: float = 0.2) -> None:
        self.epsilon = epsilon
        self.n = self.n_old = self.n_clip = 0
        self.sum_new = self.sum_old = self.sum_diff = self.sum_kl = 0.0
        self.max_kl = self.max_ratio = 0.0
        self.clip_low = self.clip_high = 0

    def add(self, inputs: Any, outputs: Any, old_logps: Sequence | None, advantages: Sequence | None) -> None:
        if outputs is None:
            return
        logps = outputs.get("logps") if hasattr(outputs, "get") else None
        if logps is None:
            raise ValueError("GRPOMetric.accumulate: the outputs carry no 'logps' (a forward_backward result's)")
        rows = [inputs] if isinstance(inputs, dict) else list(inputs)
        new_rows = _rows(logps)
        if len(new_rows) != len(rows):
            raise ValueError(f"GRPOMetric.accumulate: {len(rows)} input rows but logps for {len(new_rows)}")
        for i, (row, new_T) in enumerate(zip(rows, new_rows)):
            old = None if old_logps is None else old_logps[i]
            adv = None if advantages is None else float(advantages[i])
            self._add_row(torch.as_tensor(row["labels"]).flatten(), new_T, old, adv)

    def _add_row(self, labels: torch.Tensor, new_T: torch.Tensor, old: Any, adv: float | None) -> None:
        positions = (labels[1:] != IGNORE_INDEX).nonzero(as_tuple=True)[0]
        positions = positions[positions < new_T.numel()]
        new = new_T[positions].double()
        self.n += new.numel()
        self.sum_new += float(new.sum())
        if old is None:
            return
        old_t = torch.as_tensor(old, dtype=torch.float64).flatten()
        k = min(new.numel(), old_t.numel())
        d = new[:k] - old_t[:k]
        ratio = d.exp()
        kl = ratio - d - 1.0
        self.n_old += k
        self.sum_old += float(old_t[:k].sum())
        self.sum_diff += float(d.sum())
        self.sum_kl += float(kl.sum())
        if k:
            self.max_kl = max(self.max_kl, float(kl.max()))
            self.max_ratio = max(self.max_ratio, float(ratio.max()))
        if adv is not None:
            self.n_clip += k
            self.clip_low += int((ratio < 1 - self.epsilon).sum()) if adv < 0 else 0
            self.clip_high += int((ratio > 1 + self.epsilon).sum()) if adv > 0 else 0

    def result(self) -> dict[str, float]:
        if not self.n:
            return {}
        mean_new = self.sum_new / self.n
        out = {"train/policy_confidence": math.exp(mean_new), "train/mean_new_logp": mean_new}
        if self.n_old:
            out |= {
                "train/mean_old_logp": self.sum_old / self.n_old,
                "train/logp_diff_mean": self.sum_diff / self.n_old,
                "train/approx_kl": self.sum_kl / self.n_old,
                "train/token_kl_max": self.max_kl,
                "train/token_ratio_max": self.max_ratio,
            }
        if self.n_clip:
            out |= {
                "train/clip_ratio_low": self.clip_low / self.n_clip,
                "train/clip_ratio_high": self.clip_high / self.n_clip,
                "train/clip_ratio": (self.clip_low + self.clip_high) / self.n_clip,
            }
        return out


def _rows(logps: Any) -> list[torch.Tensor]:
    """One 1-D tensor per row: a [rows, T] tensor, or twinkle-kit's list of per-row [1, T] slices."""
    if isinstance(logps, torch.Tensor):
        return list(logps.detach().float().reshape(-1, logps.shape[-1]))
    return [row for part in logps for row in _rows(torch.as_tensor(part))]
