"""twinkle-kit's `logps` in forward_only / forward_backward outputs and forward_only(micro_batch_size=)
(twinkle.model.kit_outputs): the same numbers as our `logprobs`, in twinkle-kit's layout, and a
micro-batched call equal to the whole one."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel
from twinkle.model.families import tiny_config
from twinkle.model.transformers.moe.router_replay import RouterReplayAction

ROWS = [
    {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, -100, 7, 8, 9, 10, 11]},
    {"input_ids": [12, 13, 14, 15], "labels": [-100, 13, 14, 15]},
    {"input_ids": [21, 22, 23, 24, 25], "labels": [-100, -100, -100, 24, 25]},
]


def _model() -> TransformersModel:
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return model  # no step is taken: forward_backward's gradients only accumulate


def _rows():
    return [dict(r) for r in ROWS]


def test_logps_are_our_logprobs_shifted_as_twinkle_kit_lays_them_out():
    model = _model()
    out = model.forward_only(_rows())
    logps = out["logps"]
    assert logps.dtype == torch.float32 and logps.shape == (3, 7)
    for i, row in enumerate(ROWS):
        n = len(row["input_ids"])
        # position t: log p(token t+1); our logprobs: position t holds log p(token t), 0 first
        assert logps[i, : n - 1].tolist() == pytest.approx(out["logprobs"][i][1:], rel=1e-6)
        assert logps[i, n - 1 :].abs().sum() == 0  # past the row's end
        assert bool((logps[i, : n - 1][torch.tensor(row["labels"][1:]) != -100] < 0).all())
    assert out["logprobs"] == model.forward_only(_rows())["logprobs"]  # our key is what it was


def test_forward_only_micro_batches_equal_the_whole_call():
    model = _model()
    whole = model.forward_only(_rows())
    parts = model.forward_only(_rows(), micro_batch_size=2)
    assert parts["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    for a, b in zip(parts["logprobs"], whole["logprobs"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(parts["logps"], whole["logps"], rtol=1e-5, atol=1e-7)
    assert model.calculate_loss() == pytest.approx(whole["loss"], rel=1e-5)  # the call's loss, not a part's


def test_forward_backward_returns_the_passes_logps():
    model = _model()
    before = model.forward_only(_rows())["logps"]
    whole = model.forward_backward(_rows())
    torch.testing.assert_close(whole["logps"], before, rtol=1e-5, atol=1e-7)
    model.zero_grad()
    parts = model.forward_backward(_rows(), micro_batch_size=1)
    assert parts["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    torch.testing.assert_close(parts["logps"], before, rtol=1e-5, atol=1e-7)


def test_micro_batched_recording_is_the_whole_batchs_routing():
    torch.manual_seed(0)
    model = TransformersModel(config=tiny_config("qwen3_moe"), enable_router_replay=True)
    whole = model.forward_only(_rows(), router_replay_action=RouterReplayAction.RECORD)
    parts = model.forward_only(_rows(), router_replay_action=RouterReplayAction.RECORD, micro_batch_size=1)
    assert parts["routed_experts"].shape == whole["routed_experts"].shape
    assert torch.equal(parts["routed_experts"], whole["routed_experts"])  # -1 past each row's end in both
    assert parts["logps"].shape == (3, 7)


def test_a_value_models_micro_batches_equal_the_whole_call():
    from twinkle.model import TransformersValueModel

    torch.manual_seed(0)
    model = TransformersValueModel(model_id=TEST_MODEL)
    whole, parts = model.forward_only(_rows()), model.forward_only(_rows(), micro_batch_size=2)
    assert "logps" not in whole and len(parts["values"]) == 3
    for a, b in zip(parts["values"], whole["values"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7)
