"""Advantages against independent pure-Python computations."""

import statistics

import pytest
import torch

from twinkle.advantage import GRPOAdvantage, REINFORCEAdvantage, RLOOAdvantage, create_advantage, group_index
from twinkle.reward import RewardResult

REWARDS = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 2.0, 3.0, 7.0]


def groups_of(values, g):
    return [values[i : i + g] for i in range(0, len(values), g)]


def expected_grpo(values, g, scale_by, eps=1e-6):
    out, batch_std = [], statistics.stdev(values)
    for grp in groups_of(values, g):
        mean, std = statistics.mean(grp), statistics.stdev(grp)
        scale = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale_by]
        out += [(r - mean) / scale for r in grp]
    return out


@pytest.mark.parametrize("scale_by", ["group", "batch", "none"])
def test_grpo_matches_hand_computation(scale_by):
    adv = GRPOAdvantage(scale_by=scale_by)(REWARDS, group_size=4)
    assert adv.dtype == torch.float32
    assert adv.tolist() == pytest.approx(expected_grpo(REWARDS, 4, scale_by), abs=1e-5)
    assert adv[4:8].tolist() == [0.0] * 4  # all-equal group: no signal


def test_grpo_with_group_ids_equals_contiguous_groups_after_reordering():
    perm = [3, 11, 0, 7, 5, 9, 1, 2, 10, 4, 8, 6]
    ids = [i // 4 for i in perm]
    adv = GRPOAdvantage()([REWARDS[i] for i in perm], group_ids=ids)
    reference = GRPOAdvantage()(REWARDS, group_size=4)
    assert adv.tolist() == pytest.approx([reference[i].item() for i in perm], abs=1e-6)


def test_rloo_is_leave_one_out():
    adv = RLOOAdvantage()(REWARDS, group_size=3)
    expected = [r - (sum(grp) - r) / (len(grp) - 1) for grp in groups_of(REWARDS, 3) for r in grp]
    assert adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert RLOOAdvantage()([5.0, 1.0], group_size=1).tolist() == [0.0, 0.0]


def test_reinforce_baselines():
    assert REINFORCEAdvantage("none")([1.0, 2.0]).tolist() == [1.0, 2.0]
    assert REINFORCEAdvantage("batch")([1.0, 2.0, 6.0]).tolist() == pytest.approx([-2.0, -1.0, 3.0])
    ema = REINFORCEAdvantage("ema", momentum=0.5)
    assert ema([2.0, 4.0]).tolist() == pytest.approx([-1.0, 1.0])  # b = first batch mean 3
    assert ema([10.0, 10.0]).tolist() == pytest.approx([7.0, 7.0])  # b = 3 (then 0.5*3 + 0.5*10)
    assert ema([0.0]).tolist() == pytest.approx([-6.5])
    # what an RL checkpoint keeps: a fresh estimator given the state goes on with the same baseline
    resumed = REINFORCEAdvantage("ema", momentum=0.5)
    resumed.load_state_dict(ema.state_dict())
    assert resumed([1.0]).tolist() == ema([1.0]).tolist() == pytest.approx([1.0 - 3.25])
    with pytest.raises(ValueError, match="GRPOAdvantage keeps no state"):
        GRPOAdvantage().load_state_dict({"baseline": 1.0})


def test_failed_samples_are_masked_out_of_statistics():
    result = RewardResult([1.0, 0.0, 99.0, 1.0], errors={2: "accuracy: KeyError: 'answer'"})
    adv = GRPOAdvantage()(result, group_size=4)
    valid = [1.0, 0.0, 1.0]
    mean, std = statistics.mean(valid), statistics.stdev(valid)
    assert adv.tolist() == pytest.approx([(1 - mean) / std, (0 - mean) / std, 0.0, (1 - mean) / std], abs=1e-5)
    nan_adv = RLOOAdvantage()([1.0, float("nan"), 3.0], valid=[True, True, True])
    assert nan_adv.tolist() == pytest.approx([-2.0, 0.0, 2.0])


def test_bad_groupings_are_named():
    with pytest.raises(ValueError, match="dividing the 12 rewards"):
        GRPOAdvantage()(REWARDS, group_size=5)
    with pytest.raises(ValueError, match="3 group_ids for 12"):
        group_index(12, group_ids=[0, 1, 2])
    with pytest.raises(ValueError, match="scale_by"):
        GRPOAdvantage(scale_by="row")
    assert isinstance(create_advantage("rloo"), RLOOAdvantage)
