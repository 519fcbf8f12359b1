"""The embedded MoE preset `twinkle://qwen3-moe-tiny`: built bit-identically (pinned digest), and it
trains fused multi-tenant through MultiLoraModel, expert LoRA included, equal to each tenant alone."""

from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import resolve_model_path
from twinkle.hub.embedded import weights_digest
from twinkle.hub.embedded_moe import MOE_TEST_MODEL, PINNED_MOE_WEIGHTS, build_moe_model
from twinkle.hub.tokenizer_assets import build_tokenizer
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.structure import describe


def make_rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 800, (n, 12), generator=g).tolist()
    return [{"input_ids": row, "labels": [-100] * 3 + row[3:]} for row in ids]


@pytest.fixture(scope="module")
def moe_path():
    return resolve_model_path(MOE_TEST_MODEL)


def test_preset_builds_bit_identically_and_is_pinned(moe_path):
    assert weights_digest(Path(moe_path) / "model.safetensors") == PINNED_MOE_WEIGHTS["qwen3-moe-tiny"]
    tokenizer = build_tokenizer()
    again = build_moe_model("qwen3-moe-tiny", tokenizer).state_dict()
    for name, tensor in build_moe_model("qwen3-moe-tiny", tokenizer).state_dict().items():
        assert torch.equal(tensor, again[name]), name
    config = build_moe_model("qwen3-moe-tiny", tokenizer).config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 4, 2)


def test_preset_trains_fused_multi_tenant_equal_to_each_alone(moe_path):
    def engine():
        model = MultiLoraModel(moe_path)
        experts = describe(model.base).expert_parameters("experts")
        model.add_adapter_to_model(
            "a", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", target_parameters=experts)
        )
        model.add_adapter_to_model("b", LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=experts))
        for name in ("a", "b"):
            model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
        return model

    data = {"a": make_rows(3, seed=1), "b": make_rows(2, seed=2)}
    fused, alone = engine(), engine()
    losses = {"a": [], "b": []}
    for _ in range(3):
        out = fused.forward_backward_fused(data)
        for name in data:
            fused.clip_grad_and_step(adapter_name=name)
            single = alone.forward_backward(data[name], name)
            alone.clip_grad_and_step(adapter_name=name)
            assert single["loss"] == pytest.approx(out[name]["loss"], rel=1e-4)
            losses[name].append(out[name]["loss"])
    for name in data:
        assert losses[name][-1] < losses[name][0] - 0.05  # the expert LoRA trains
        for p, q in zip(fused.adapters[name].params, alone.adapters[name].params):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
