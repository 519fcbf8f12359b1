"""A serving engine gives memory back: freed heap trimmed once idle, the frozen base held once."""

import time

import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.memory import IdleTrimmer, release_free_memory, share_frozen_weights


def wait_for(predicate, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.02)
    return predicate()


def test_trimmer_waits_for_quiet_then_trims_once():
    assert release_free_memory()  # glibc here
    trimmer = IdleTrimmer(idle_seconds=1.0)
    time.sleep(1.2)
    assert trimmer.trims == 0  # never touched: nothing to give back
    for _ in range(5):  # a busy stretch: no trim between passes
        trimmer.touch()
        time.sleep(0.05)
    assert trimmer.trims == 0
    assert wait_for(lambda: trimmer.trims == 1)
    time.sleep(1.2)
    assert trimmer.trims == 1  # idle stays trimmed once, until the next work


def test_engine_touches_its_trimmer_on_passes_steps_and_removals():
    model = MultiLoraModel(TEST_MODEL)
    model.add_adapter_to_model("a", LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-3)
    model.release_memory_when_idle(0.2)
    model.forward_backward([{"input_ids": [5, 6, 7, 8]}])
    model.clip_grad_and_step()
    assert wait_for(lambda: model._trimmer.trims >= 1)
    trims = model._trimmer.trims
    model.remove_adapter("a")
    assert wait_for(lambda: model._trimmer.trims == trims + 1)


def test_sampler_copy_shares_the_trained_models_frozen_base():
    engine = MultiLoraModel(TEST_MODEL)
    engine.add_adapter_to_model("a", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))  # wrapped layers
    other = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = other(input_ids=ids).logits
    shared = share_frozen_weights(engine.base, other)
    assert shared == sum(p.numel() * 4 for p in other.parameters())  # every parameter, the tied head once
    q = engine.base.get_submodule("model.layers.0.self_attn.q_proj").base_layer.weight
    assert other.get_submodule("model.layers.0.self_attn.q_proj").weight.data_ptr() == q.data_ptr()
    with torch.no_grad():
        assert torch.equal(other(input_ids=ids).logits, before)
    assert share_frozen_weights(engine.base, other) == 0  # already shared
