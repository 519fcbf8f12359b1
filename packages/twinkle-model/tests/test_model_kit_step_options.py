"""twinkle-kit's `TransformersModel(ddp_config=)` and per-call `clip_grad_and_step(gradient_accumulation_steps=)`
as keyword arguments of ours: a window set per call trains exactly as one set on the adapter, a window that
cannot change now is refused, and DDP options we cannot honour are refused by name (that the options reach
DDP over two processes: test_loss_infonce_data_parallel.py)."""

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.mesh import DeviceMesh
from twinkle.model import TransformersModel
from twinkle.model.strategy import check_ddp_config

ROWS = [
    {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, 8, 9]},
    {"input_ids": [11, 12, 13], "labels": [-100, 12, 13]},
]


def _model(gradient_accumulation_steps: int) -> TransformersModel:
    model = TransformersModel(model_id=TEST_MODEL)
    torch.manual_seed(0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model.add_adapter_to_model("default", lora, gradient_accumulation_steps=gradient_accumulation_steps)
    model.set_optimizer("SGD", lr=0.5)
    return model


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.optimizer_group["default"].state.params]


def test_a_window_given_per_step_trains_as_the_adapters_own():
    fixed, per_call = _model(2), _model(1)
    start = _weights(per_call)
    for i, row in enumerate(ROWS):
        fixed.forward_backward([row])
        per_call.forward_backward([row])
        a, b = fixed.clip_grad_and_step(), per_call.clip_grad_and_step(gradient_accumulation_steps=2)
        assert a["stepped"] is b["stepped"] is (i == 1)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    for a, b in zip(_weights(fixed), _weights(per_call)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(not torch.equal(a, b) for a, b in zip(start, _weights(per_call)))  # it trained
    per_call.forward_backward([ROWS[0]])
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1: 1 micro-batch.* of a window of 2"):
        per_call.clip_grad_and_step(gradient_accumulation_steps=1)
    with pytest.raises(ValueError, match="must be a positive integer, got 0"):
        per_call.clip_grad_and_step(gradient_accumulation_steps=0)


def test_ddp_options_we_cannot_honour_are_refused_by_name():
    with pytest.raises(ValueError, match=r"ddp_config \['comm_hook'\] cannot be honoured"):
        TransformersModel(model_id=TEST_MODEL, ddp_config={"find_unused_parameters": True, "comm_hook": "fp16"})
    fsdp = DeviceMesh.from_sizes(fsdp_size=2)
    with pytest.raises(ValueError, match=r"ddp_config \['find_unused_parameters'\].*wraps the model in FSDP2"):
        check_ddp_config({"find_unused_parameters": True}, "fsdp2", fsdp)
    assert check_ddp_config({"static_graph": True}, "ddp", DeviceMesh.from_sizes(dp_size=2)) == {"static_graph": True}
    assert check_ddp_config(None, "fsdp2", fsdp) == {}
