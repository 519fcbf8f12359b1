"""One checkpoint format across engines: TransformersModel and MultiLoraModel each resume the other's
checkpoint with bit-exact weights, optimizer and scheduler state, then train on as the saver would;
peft loads either folder; training state is safetensors + JSON, never a pickle."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model_state_dict
from transformers import AutoModelForCausalLM

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model import TransformersModel
from twinkle.model.multi_lora import MultiLoraModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
CROSS_ENGINE_ATOL = 1e-5  # the fused multi-LoRA layer and peft's add the same terms in another order


def _configure(engine):
    engine.set_optimizer("AdamW", lr=2e-2, weight_decay=0.01)
    engine.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=6)


def _transformers():
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LORA)
    return model


def _multi_lora():
    model = MultiLoraModel(TEST_MODEL)
    model.add_adapter_to_model("default", LORA)
    return model


def _weights(engine):
    if isinstance(engine, MultiLoraModel):
        return {k: v.detach().clone() for k, v in engine.adapter_state_dict("default").items()}
    return {
        k: v.detach().clone() for k, v in get_peft_model_state_dict(engine.peft_model, adapter_name="default").items()
    }


def _optimizer(engine):
    state = engine.adapters["default"] if isinstance(engine, MultiLoraModel) else engine.states["default"]
    return state.optimizer.state_dict(), state.scheduler.state_dict()


def _train(engine, rows, steps):
    losses = []
    for i in range(steps):
        losses.append(engine.forward_backward(inputs=rows[i % 2 * 2 : i % 2 * 2 + 2])["loss"])
        assert engine.clip_grad_and_step()["stepped"]
    return losses


def _assert_same_state(a, b):
    assert _weights(a).keys() == _weights(b).keys()
    assert all(torch.equal(_weights(a)[k], _weights(b)[k]) for k in _weights(a))
    (opt_a, sched_a), (opt_b, sched_b) = _optimizer(a), _optimizer(b)
    assert opt_a["param_groups"] == opt_b["param_groups"] and sched_a == sched_b
    for i, moments in opt_a["state"].items():
        assert all(torch.equal(v, opt_b["state"][i][k]) for k, v in moments.items())


@pytest.mark.parametrize(
    "saver,loader",
    [(_transformers, _multi_lora), (_multi_lora, _transformers)],
    ids=["transformers->multi_lora", "multi_lora->transformers"],
)
def test_a_checkpoint_resumes_bit_exact_in_the_other_engine(rows, tmp_path, saver, loader):
    first = saver()
    _configure(first)
    _train(first, rows, 2)
    first.save(tmp_path / "ckpt", save_training_state=True)
    files = sorted(str(p.relative_to(tmp_path / "ckpt")) for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert files == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "training_state/state.json",
        "training_state/state.safetensors",
    ]

    other = loader()
    _configure(other)
    assert other.resume_from_checkpoint(tmp_path / "ckpt") == {
        "data_position": 2,
        "optimizer_steps": 2,
        "micro_step": 0,
        "cur_step": 2,  # twinkle-kit's keys, from both engines
        "consumed_train_samples": 0,
        "gradient_accumulation_steps": 1,
    }
    _assert_same_state(first, other)
    # both train on from the same state: equal up to the engines' summation order
    expected, got = _train(first, rows, 2), _train(other, rows, 2)
    assert got == pytest.approx(expected, abs=CROSS_ENGINE_ATOL)
    worst = max((_weights(first)[k] - _weights(other)[k]).abs().max().item() for k in _weights(first))
    assert worst <= CROSS_ENGINE_ATOL


def test_multi_lora_resume_equals_the_uninterrupted_run_bit_exact(rows, tmp_path):
    straight = _multi_lora()
    _configure(straight)
    full = _train(straight, rows, 4)

    first = _multi_lora()
    _configure(first)
    losses = _train(first, rows, 2)
    first.save(tmp_path / "ckpt", save_training_state=True)
    resumed = _multi_lora()
    _configure(resumed)
    resumed.resume_from_checkpoint(tmp_path / "ckpt")
    assert losses + _train(resumed, rows, 2) == full  # bit-exact
    _assert_same_state(straight, resumed)


def test_peft_loads_the_folder_and_the_hub_id_is_recorded(rows, tmp_path):
    model = _multi_lora()
    _configure(model)
    _train(model, rows, 1)
    model.save(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == resolve_model_path(TEST_MODEL)  # not a hub model: its folder
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL))
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "ckpt")).eval()
    ids = torch.tensor([rows[0]["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model.logits(rows[:1]), atol=1e-5)

    from twinkle.model.checkpoint import base_model_id

    assert base_model_id("hf://Qwen/Qwen3-0.6B", "/cache/x") == "Qwen/Qwen3-0.6B"
    assert base_model_id("ms://Qwen/Qwen3-0.6B", "/cache/x") == "Qwen/Qwen3-0.6B"
    assert base_model_id("twinkle://qwen3-tiny", "/cache/x") == "/cache/x"
