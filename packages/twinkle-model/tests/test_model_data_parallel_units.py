"""What a data-parallel step counts in: each loss declares its unit (`Loss.units`: loss tokens, pairs,
sequences), and a pass split over ranks (or into pieces) merges its records over those units
(`strategy.merge_records`) into the record one process makes of the whole pass."""

from __future__ import annotations

import pytest
import torch

from twinkle.loss import CrossEntropyLoss, DPOLoss, Loss, StableReinforceLoss
from twinkle.metric import ForwardRecord
from twinkle.model.strategy import RankRecord, merge_records

# 4 rows, -100 where no loss: loss tokens 3, 1, 0, 2
TARGETS_B_T = torch.tensor([[5, 6, 7], [-100, -100, 9], [-100, -100, -100], [-100, 4, 4]])


class _SequenceLoss(Loss):
    unit = "sequence"


def test_each_loss_counts_its_own_units_from_the_targets_alone():
    assert CrossEntropyLoss().units(TARGETS_B_T, {}) == 6.0  # loss tokens
    assert DPOLoss().units(TARGETS_B_T, {}) == 2.0  # (chosen, rejected) pairs
    assert _SequenceLoss().units(TARGETS_B_T, {}) == 3.0  # rows with a loss token
    sampled = {"sampled_mask": torch.tensor([[1.0, 0.0, 1.0], [1, 1, 1], [1, 1, 1], [0, 0, 1]])}
    # stable_reinforce's mean is over the sampled loss tokens, and its parse-error `mask` (per row)
    assert StableReinforceLoss().units(TARGETS_B_T, sampled) == 4.0
    assert StableReinforceLoss().units(TARGETS_B_T, {**sampled, "mask": torch.tensor([1.0, 0.0, 1.0, 1.0])}) == 3.0


def _record(loss, tokens, **extras):
    return ForwardRecord(loss, tokens, tokens, 0, 0.1, 1.0, True, extras)


def test_records_merge_over_the_loss_units():
    # part 0: two rows, 3 loss tokens; part 1: one row, 1 loss token
    parts = [RankRecord(_record(3.0, 3, clip=0.5), 2, 3.0), RankRecord(_record(4.0, 1, clip=0.0), 1, 1.0)]
    summed = merge_records(parts, CrossEntropyLoss(reduction="sum"))  # Tinker's: the batch's loss is the sum
    assert (summed.loss, summed.loss_tokens, summed.finite) == (7.0, 4, True)
    assert summed.extras == {"clip": pytest.approx(0.375)}  # a built-in loss's metric: a mean over its units
    assert merge_records(parts, CrossEntropyLoss()).loss == pytest.approx((3.0 * 3 + 4.0 * 1) / 4)  # a token mean
    # a preference loss: a mean over pairs, whatever the tokens (10 loss tokens in one pair, 2 in the other)
    pairs = [
        RankRecord(_record(0.5, 10, reward_accuracy=1.0), 2, 1.0),
        RankRecord(_record(0.9, 2, reward_accuracy=0.0), 2, 1.0),
    ]
    dpo = merge_records(pairs, DPOLoss())
    assert dpo.loss == pytest.approx(0.7) and dpo.extras == {"reward_accuracy": pytest.approx(0.5)}
    nan = merge_records(
        [parts[0], RankRecord(ForwardRecord(float("nan"), 1, 1, 0, 0.1, 1.0, False, {}), 1, 1.0)], CrossEntropyLoss()
    )
    assert not nan.finite and nan.loss != nan.loss and nan.extras == {}
    unscored = merge_records([parts[0], RankRecord(_record(float("nan"), 0), 1, 0.0)], CrossEntropyLoss())
    assert unscored.finite and unscored.loss == 3.0  # a part without a loss token does not count


def test_a_custom_loss_merges_its_metrics_as_it_says():
    class Summed(Loss):
        def metric_merge(self, key):
            return "sum" if key.endswith(":sum") else "row_mean"

    custom = [
        RankRecord(_record(3.0, 3, **{"n:sum": 2.0, "m:mean": 1.0}), 2, 3.0),
        RankRecord(_record(4.0, 1, **{"n:sum": 1.0, "m:mean": 4.0}), 1, 1.0),
    ]
    assert merge_records(custom, Summed()).extras == {"n:sum": 3.0, "m:mean": pytest.approx(2.0)}  # over rows


@pytest.mark.parametrize(
    "sizes, message",
    [
        (dict(dp_size=1, fsdp_size=2), "fsdp_size=2: give those ranks to dp, or use TransformersModel"),
        (dict(tp_size=2), "tp_size=2"),
        (dict(pp_size=2), "use MegatronModel for pp"),
    ],
)
def test_multi_lora_model_implements_dp_only(sizes, message):
    from twinkle.hub import TEST_MODEL
    from twinkle.mesh import DeviceMesh
    from twinkle.model.multi_lora import MultiLoraModel

    with pytest.raises(ValueError, match=message):
        MultiLoraModel(TEST_MODEL, device_mesh=DeviceMesh.from_sizes(**sizes))
