"""Tenants with equally sized batches and equal ranks share one batched (bmm) LoRA matmul per
layer; other tenants get their own matmuls at their own rank (never padded): losses and gradients
still equal each adapter trained alone in peft."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from twinkle.hub import TEST_MODEL, resolve_model_path
from twinkle.model.multi_lora import MultiLoraModel

torch.set_num_threads(2)

# mixed ranks (2..16), scalings, rsLoRA and overlapping but different targets in one group
CONFIGS = {
    "r4": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
    "r16": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True),
    "r2": LoraConfig(r=2, lora_alpha=4, target_modules="all-linear"),
    "r8": LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "o_proj", "gate_proj"]),
}


def batch(seed, rows=2, length=14):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 800, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


DATA = {name: batch(i) for i, name in enumerate(CONFIGS)}


def randomise(params, name):
    g = torch.Generator().manual_seed(len(name) * 7 + 1)
    with torch.no_grad():  # B starts at zero: give every factor a value so every gradient is non-trivial
        for p in params:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def engine_grads():
    model = MultiLoraModel(TEST_MODEL)
    for name, config in CONFIGS.items():
        model.add_adapter_to_model(name, config)
        randomise(model.adapters[name].params, name)
    out = model.forward_backward_fused({n: {"input_ids": ids, "labels": labels} for n, (ids, labels) in DATA.items()})
    grads = {}
    for name in CONFIGS:
        state_dict = model.adapter_state_dict(name)
        grads[name] = {k: p.grad.clone() for k, p in state_dict.items()}
    return model, {n: r["loss"] for n, r in out.items()}, grads


def peft_alone(name, model):
    """The same adapter values in a real peft model, trained alone on its own batch."""
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
    peft_model = get_peft_model(base, CONFIGS[name])
    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for key, value in model.adapter_state_dict(name).items():
            params[key.replace(".weight", ".default.weight")].copy_(value)
    ids, labels = DATA[name]
    logits = peft_model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
    loss.backward()
    return float(loss.detach()), {
        k.replace(".default.weight", ".weight"): p.grad for k, p in params.items() if p.requires_grad
    }


def test_grouped_pass_over_mixed_ranks_equals_peft_per_adapter():
    model, losses, grads = engine_grads()
    layer = model.base.get_submodule("model.layers.0.self_attn.q_proj")
    model.routing.set([(name, 2, 14) for name in CONFIGS], training=True)
    groups = layer._plan(torch.zeros(8, 14, layer.in_features), layer._segments(8))
    model.routing.clear()
    # q_proj carries r4, r16, r2, r8: four ranks, four groups, each at its own rank
    assert [(g.count, g.rank) for g in groups] == [(1, 4), (1, 16), (1, 2), (1, 8)]
    for name in CONFIGS:
        loss, peft_grads = peft_alone(name, model)
        assert losses[name] == pytest.approx(loss, rel=1e-5)
        assert grads[name].keys() == peft_grads.keys()
        for key, grad in grads[name].items():
            assert grad.shape == peft_grads[key].shape
            torch.testing.assert_close(grad, peft_grads[key], atol=1e-6, rtol=1e-4, msg=f"{name} {key}")


def test_grouped_pass_equals_one_tenant_per_pass_with_dropout():
    configs = {
        "d4": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.2),
        "d8": LoraConfig(r=8, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1),
    }
    models = [MultiLoraModel(TEST_MODEL), MultiLoraModel(TEST_MODEL)]
    for model in models:
        for name, config in configs.items():
            model.add_adapter_to_model(name, config)
            randomise(model.adapters[name].params, name)
    data = {name: {"input_ids": ids, "labels": labels} for name, (ids, labels) in zip(configs, DATA.values())}
    fused = models[0].forward_backward_fused(data)
    alone = {name: models[1].forward_backward(rows, adapter_name=name) for name, rows in data.items()}
    for name in configs:
        assert fused[name]["loss"] == pytest.approx(alone[name]["loss"], rel=1e-5)
        for p, q in zip(models[0].adapters[name].params, models[1].adapters[name].params):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4)
