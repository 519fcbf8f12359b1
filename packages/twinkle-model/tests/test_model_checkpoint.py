"""Checkpoints: PEFT folders, full saves, and bit-exact resume on CPU fp32."""

import json

import torch
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def _trained(rows, name="tenant", steps=2, save_state=False):
    torch.manual_seed(0)
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model(name, LORA)
    m.set_optimizer("AdamW", lr=5e-2)
    for _ in range(steps):
        m.forward_backward(inputs=rows)
        m.clip_grad_and_step()
    return m


def _logits(model, rows):
    ids = torch.tensor([rows[0]["input_ids"]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_save_is_a_peft_folder_with_identical_logits(rows, tiny_path, tmp_path):
    m = _trained(rows, name="tenant")  # a non-default name still saves flat
    out = tmp_path / "lora"
    m.save(out)
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == tiny_path
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path), str(out)).eval()
    ours = _logits(m.peft_model.eval(), rows)
    assert torch.equal(_logits(loaded, rows), ours)
    assert not torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tiny_path), rows), ours)  # it trained

    fresh = TransformersModel(model_id=TEST_MODEL)
    fresh.add_adapter_to_model("other", LORA)
    fresh.load(out)
    assert torch.equal(_logits(fresh.peft_model.eval(), rows), ours)


def test_full_save_loads_with_automodel(rows, tmp_path):
    torch.manual_seed(0)
    m = TransformersModel(model_id=TEST_MODEL)
    m.set_optimizer("AdamW", lr=1e-2)
    m.forward_backward(inputs=rows)
    m.clip_grad_and_step()
    m.save(tmp_path / "full")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    assert torch.equal(_logits(loaded, rows), _logits(m.hf_model, rows))


def _run(rows_per_step, model, losses):
    for batch in rows_per_step:
        losses.append(model.forward_backward(inputs=batch)["loss"])
        model.clip_grad_and_step()


def _configured(gas):
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("default", LORA, gradient_accumulation_steps=gas)
    m.set_optimizer("AdamW", lr=3e-2, weight_decay=0.01)
    m.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=8)
    return m


def test_resume_equals_uninterrupted_loss_trajectory(rows, tmp_path):
    batches = [rows[i % 2 * 2 : i % 2 * 2 + 2] for i in range(8)]
    torch.manual_seed(1)
    full_losses = []
    _run(batches, _configured(gas=2), full_losses)

    torch.manual_seed(1)
    first = _configured(gas=2)
    losses = []
    _run(batches[:4], first, losses)
    first.save(tmp_path / "ckpt", save_training_state=True)
    draw_after_save = torch.rand(3)

    torch.manual_seed(123)  # a different process state: resume must restore the RNG too
    resumed = _configured(gas=2)
    info = resumed.resume_from_checkpoint(tmp_path / "ckpt")
    # ours, then twinkle-kit's names for the same progress (cur_step = optimizer steps)
    assert info == {
        "data_position": 4,
        "optimizer_steps": 2,
        "micro_step": 0,
        "consumed_train_samples": 0,
        "cur_step": 2,
        "gradient_accumulation_steps": 2,
    }
    assert torch.equal(torch.rand(3), draw_after_save)
    _run(batches[info["data_position"] :], resumed, losses)
    assert losses == full_losses  # bit-exact, not approximately
