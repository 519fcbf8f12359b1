"""Metrics helpers against independent loops over tokens."""

import math

import pytest
import torch

from twinkle.reward import AnswerAccuracy, FormatReward, WeightedReward
from twinkle.rl.metrics import (
    clip_fraction,
    entropy,
    importance_ratio_stats,
    kl_to_reference,
    reward_metrics,
    sampled_entropy,
)
from twinkle.rl.timing import PhaseTimer

torch.manual_seed(0)
LOGP = -torch.rand(3, 5) * 3
REF = -torch.rand(3, 5) * 3
MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
TOKENS = [(b, t) for b in range(3) for t in range(5) if MASK[b, t]]


def test_reward_metrics_per_component_over_valid_samples():
    combo = WeightedReward({"acc": (AnswerAccuracy(answer_key="answer"), 1.0), "fmt": (FormatReward(r"^\d+$"), 0.5)})
    result = combo(["3", "x 3", "4", "5"], [{"answer": "3"}, {"answer": "3"}, {"answer": "5"}, {}])
    m = reward_metrics(result)
    totals = [1.5, 1.0, 0.5]  # sample 3 failed
    mean = sum(totals) / 3
    assert m["reward/mean"] == pytest.approx(mean)
    assert m["reward/std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in totals) / 3))
    assert m["reward/acc/mean"] == pytest.approx(2 / 3) and m["reward/fmt/mean"] == pytest.approx(2 / 3)
    assert m["reward/failed"] == 0.25


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators(estimator):
    def k(d):
        return {"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[estimator]

    expected = sum(k(float(REF[b, t] - LOGP[b, t])) for b, t in TOKENS) / len(TOKENS)
    assert kl_to_reference(LOGP, REF, MASK, estimator) == pytest.approx(expected, rel=1e-5)


def test_clip_fraction_counts_active_clips():
    old = LOGP.clone()
    new = old + torch.tensor([[0.5, -0.5, 0.0, 9, 9], [9, 0.5, -0.5, 0.1, -0.1], [0.5, 0, 0, 0, 0]])
    adv = torch.tensor([1.0, -1.0, -1.0])
    count = 0
    for b, t in TOKENS:
        r = math.exp(float(new[b, t] - old[b, t]))
        count += (r > 1.28 and adv[b] > 0) or (r < 0.8 and adv[b] < 0)
    assert clip_fraction(new, old, adv, MASK) == pytest.approx(count / len(TOKENS))
    assert count == 2  # (0,0): r=1.65 with A>0; (1,2): r=0.61 with A<0; (2,0) has r>1 with A<0: unclipped


def test_entropy_and_sampled_entropy():
    logits = torch.randn(3, 5, 7)
    expected = 0.0
    for b, t in TOKENS:
        p = torch.softmax(logits[b, t].double(), -1)
        expected += float(-(p * p.log()).sum())
    assert entropy(logits, MASK) == pytest.approx(expected / len(TOKENS), rel=1e-5)
    assert sampled_entropy([[-1.0, -2.0], [None, -3.0]]) == pytest.approx(2.0)


def test_importance_ratio_stats():
    stats = importance_ratio_stats(LOGP, REF, MASK)
    w = [math.exp(float(LOGP[b, t] - REF[b, t])) for b, t in TOKENS]
    mean = sum(w) / len(w)
    assert stats["is_ratio/mean"] == pytest.approx(mean)
    assert stats["is_ratio/std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in w) / len(w)))
    assert stats["is_ratio/max"] == pytest.approx(max(w)) and stats["is_ratio/min"] == pytest.approx(min(w))
    assert stats["is_ratio/ess"] == pytest.approx(sum(w) ** 2 / (len(w) * sum(x * x for x in w)))
    rows = [[float(LOGP[b, t] - REF[b, t]) for t in range(5) if MASK[b, t]] for b in range(3)]
    assert stats["is_ratio/seq_mean"] == pytest.approx(sum(math.exp(sum(r) / len(r)) for r in rows) / 3)


def test_phase_timer_shares():
    now = [0.0]
    timer = PhaseTimer(clock=lambda: now[0])
    for name, dt in [("sample", 2.0), ("score", 0.5), ("train", 1.0), ("sync", 0.5)]:
        with timer.phase(name):
            now[0] += dt
    m = timer.step_metrics()
    assert m["time/step"] == 4.0 and m["share/sample"] == 0.5 and m["time/sync"] == 0.5
    now[0] += 4.0
    s = timer.summary()
    assert s["time/wall"] == 8.0 and s["steps_per_s"] == 1 / 8 and s["share/train"] == 1 / 8
