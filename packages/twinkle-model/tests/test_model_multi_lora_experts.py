"""LoRA on MoE experts' 3-D weights in the fused multi-tenant engine: fused equals each tenant alone,
the saved folder is peft's `target_parameters` layout (peft loads it and computes the same loss), and
the grouped matmul equals the per-expert products it replaces."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from twinkle.model.families import tiny_model
from twinkle.model.multi_lora import MultiLoraModel
from twinkle.model.multi_lora.experts import MultiLoraExperts, grouped_mm
from twinkle.model.structure import describe

torch.set_num_threads(2)
MOE = ("qwen3_moe", "gpt_oss", "deepseek_v3")


def rows(seed, n, length, vocab=256):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] * 2 + ids[2:]})
    return out


def configs(model):
    experts = describe(model).expert_parameters("experts")
    return {
        "alice": LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"], target_parameters=experts),
        "bob": LoraConfig(r=2, lora_alpha=2, target_modules=[], target_parameters=experts),
        "carol": LoraConfig(
            r=4, lora_alpha=4, target_modules=[], target_parameters=[e for e in experts if "down" in e]
        ),
    }


def engine(family):
    base = tiny_model(family)
    model = MultiLoraModel(model=copy.deepcopy(base))
    for name, config in configs(base).items():
        model.add_adapter_to_model(name, config)
        with torch.no_grad():  # B starts at zero: make every factor matter
            g = torch.Generator().manual_seed(len(name))
            for p in model.adapters[name].params:
                p.normal_(0, 0.3, generator=g)
    return base, model


DATA = {"alice": rows(1, 2, 9), "bob": rows(2, 1, 7), "carol": rows(3, 3, 9)}


def grads(model, name):
    return [p.grad.clone() for p in model.adapters[name].params]


@pytest.mark.parametrize("family", MOE)
def test_fused_tenants_equal_each_alone_with_expert_lora(family):
    _, model = engine(family)
    assert any(isinstance(m, MultiLoraExperts) for m in model.base.modules())
    fused = model.forward_backward_fused(DATA, return_logprobs=True)
    fused_grads = {n: grads(model, n) for n in DATA}
    for name in DATA:
        for p in model.adapters[name].params:
            assert p.grad is not None and p.grad.abs().sum() > 0  # experts' factors do get gradient
            p.grad = None
    for name, data in DATA.items():
        alone = model.forward_backward_fused({name: data}, return_logprobs=True)[name]
        assert alone["loss"] == pytest.approx(fused[name]["loss"], rel=1e-5, abs=1e-6)
        for a, b in zip(grads(model, name), fused_grads[name]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        for p in model.adapters[name].params:
            p.grad = None


@pytest.mark.parametrize("family", MOE)
def test_saved_expert_adapter_loads_in_peft_and_gives_the_same_loss(family, tmp_path):
    base, model = engine(family)
    expected_keys = set(get_peft_model_state_dict(get_peft_model(copy.deepcopy(base), configs(base)["alice"])))
    assert set(k.replace(".default.", ".") for k in model.adapter_state_dict("alice")) == expected_keys
    model.save(tmp_path / "alice", "alice")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "alice", is_trainable=True).eval()
    batch = DATA["alice"]
    ids = torch.tensor([r["input_ids"] for r in batch])
    labels = torch.tensor([r["labels"] for r in batch])
    with torch.no_grad():
        ref = peft_model(input_ids=ids, labels=labels).loss
        plain = base(input_ids=ids, labels=labels).loss
    ours = model.forward_only(batch, "alice")["loss"]
    assert ours == pytest.approx(float(ref), rel=1e-5)
    assert abs(float(plain) - float(ref)) > 1e-3  # the expert factors change the loss: the check has teeth
    # gradients too: peft's on its ParamWrapper factors equal ours, tensor by tensor (same layout)
    peft_model(input_ids=ids, labels=labels).loss.backward()
    model.forward_backward(batch, "alice")
    theirs = {n.replace(".default.", "."): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}
    for key, param in model.adapter_state_dict("alice").items():
        torch.testing.assert_close(param.grad, theirs[key], rtol=1e-4, atol=1e-6)
    reloaded = MultiLoraModel(model=copy.deepcopy(base))
    reloaded.load(tmp_path / "alice", "alice")
    assert reloaded.forward_only(batch, "alice")["loss"] == pytest.approx(ours, rel=1e-6)


def test_grouped_mm_equals_per_group_products():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 5, generator=g), torch.randn(4, 5, 3, generator=g)
    group = torch.tensor([3, 0, 3, 1, 0, 3, 3, 1, 0, 0, 3])  # group 2 unused
    expected = torch.stack([x[i] @ w[group[i]] for i in range(11)])
    torch.testing.assert_close(grouped_mm(x, w, group), expected)


def test_parked_and_spilled_expert_adapters_resume_exactly(tmp_path):
    _, model = engine("qwen3_moe")
    model.enable_spill(tmp_path)
    for name in DATA:
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
    model.forward_backward_fused(DATA)
    for name in DATA:
        model.clip_grad_and_step(adapter_name=name)
    before = {n: [p.detach().clone() for p in model.adapters[n].params] for n in DATA}
    model.park_adapter("alice")
    model.spill_adapter("bob")
    assert model.adapter_tier("alice") == "parked" and model.adapter_tier("bob") == "spilled"
    for layer in (m for m in model.base.modules() if isinstance(m, MultiLoraExperts)):
        assert layer.adapter_names() == {"carol"}  # away adapters leave the experts
    after = model.forward_backward_fused(DATA)  # brings both back
    for name in DATA:
        for p, q in zip(model.adapters[name].params, before[name]):
            assert torch.equal(p.detach(), q)
        model.clip_grad_and_step(adapter_name=name)  # the optimizer follows the restored factors
    reference = engine("qwen3_moe")[1]
    for name in DATA:
        reference.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
    reference.forward_backward_fused(DATA)
    for name in DATA:
        reference.clip_grad_and_step(adapter_name=name)
    again = reference.forward_backward_fused(DATA)
    for name in DATA:
        assert after[name]["loss"] == pytest.approx(again[name]["loss"], rel=1e-6)


def test_expert_targets_refuse_dropout_and_unknown_weights():
    base = tiny_model("qwen3_moe")
    model = MultiLoraModel(model=base)
    experts = describe(base).expert_parameters("experts")
    with pytest.raises(ValueError, match="lora_dropout != 0 does not work with target_parameters"):
        model.add_adapter_to_model("a", LoraConfig(r=2, target_modules=[], target_parameters=experts, lora_dropout=0.1))
    with pytest.raises(ValueError, match="'mlp.nothing' names no expert weight"):
        model.add_adapter_to_model("a", LoraConfig(r=2, target_modules=[], target_parameters=["mlp.nothing"]))
    assert model.adapter_names == []
    model.add_adapter_to_model("a", LoraConfig(r=2, target_modules=[], target_parameters=experts))
    model.remove_adapter("a")
    assert not any(isinstance(m, MultiLoraExperts) for m in base.modules())  # unwrapped again
