"""GRPOMetric used standalone, as twinkle-kit's GRPO loops use it: accumulate(rows, forward_backward's
outputs, old_logps=, advantages=) then calculate(), against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from twinkle.metric import GRPOMetric

# two rows: 2 prompt tokens then 3 completion tokens, and 1 prompt token then 2 completion tokens
ROWS = [{"labels": [-100, -100, 7, 8, 9]}, {"labels": [-100, 4, 5]}]
# logps[t] is log p(token t+1): the completion tokens sit at t = 1..3 (row 0) and t = 0..1 (row 1)
LOGPS = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0], [-0.2, -3.0, 0.0, 0.0, 0.0]])
OLD = [[-1.0, -1.5, -0.5], [-0.2, -2.0]]


def test_accumulate_then_calculate_gives_the_drift_from_the_sampling_policy():
    metric = GRPOMetric()
    # twinkle-kit's scripts hand the logps over as one [1, T] slice per row
    metric.accumulate(ROWS, {"logps": [LOGPS[i : i + 1] for i in range(2)]}, old_logps=OLD, advantages=[1.0, -1.0])
    out = metric.calculate()
    d = [0.0, -0.5, 0.0, 0.0, -1.0]  # new - old per completion token
    kl = [math.exp(x) - x - 1 for x in d]
    assert out["train/mean_new_logp"] == pytest.approx(-6.7 / 5)
    assert out["train/policy_confidence"] == pytest.approx(math.exp(-6.7 / 5))
    assert out["train/mean_old_logp"] == pytest.approx(-5.2 / 5)
    assert out["train/logp_diff_mean"] == pytest.approx(-1.5 / 5)
    assert out["train/approx_kl"] == pytest.approx(sum(kl) / 5)
    assert out["train/token_kl_max"] == pytest.approx(max(kl))
    assert out["train/token_ratio_max"] == pytest.approx(1.0)
    # ratio e^-0.5 = 0.61 < 0.8 in row 0 (advantage > 0: not a clip) and e^-1 in row 1 (advantage < 0: one)
    assert out["train/clip_ratio_low"] == pytest.approx(1 / 5)
    assert out["train/clip_ratio_high"] == 0.0 and out["train/clip_ratio"] == pytest.approx(1 / 5)
    assert metric.calculate() == {}, "calculate resets"


def test_without_old_logps_only_the_new_policy_is_reported_and_mismatches_are_refused():
    metric = GRPOMetric()
    metric.accumulate(ROWS, {"logps": LOGPS})
    assert set(metric.calculate()) == {"train/mean_new_logp", "train/policy_confidence"}
    with pytest.raises(ValueError, match="2 input rows but logps for 1"):
        metric.accumulate(ROWS, {"logps": LOGPS[:1]})
    with pytest.raises(ValueError, match="no 'logps'"):
        metric.accumulate(ROWS, {"loss": 1.0})
