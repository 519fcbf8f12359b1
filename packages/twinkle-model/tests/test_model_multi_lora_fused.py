"""A fused multi-tenant pass equals each tenant run alone: gradients, losses, weights after steps."""

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora import MultiLoraModel

torch.set_num_threads(2)

CONFIGS = {
    "alice": LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1),
    "bob": LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "carol": LoraConfig(r=2, lora_alpha=4, target_modules=r".*mlp\.down_proj"),
}


def make_rows(seed, n, lengths, vocab=800):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
        labels = [-100] * 3 + ids[3:]  # a prompt without loss, like a template's output
        rows.append({"input_ids": ids, "labels": labels})
    return rows


DATA = {"alice": make_rows(1, 2, [16, 12]), "bob": make_rows(2, 3, [11]), "carol": make_rows(3, 1, [20])}


def make_model(**losses):
    model = MultiLoraModel(TEST_MODEL)
    for name, config in CONFIGS.items():
        model.add_adapter_to_model(name, config)
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-3)
        with torch.no_grad():  # B starts at zero; make every adapter matter from the first pass
            g = torch.Generator().manual_seed(len(name))
            for p in model.adapters[name].params:
                p.normal_(0, 0.05, generator=g)
    for name, loss in losses.items():
        model.set_loss(loss, adapter_name=name)
    return model


def max_diff(xs, ys):
    return max((x - y).abs().max().item() for x, y in zip(xs, ys))


# Fused rows and one tenant's rows alone reduce in other kernel blocks: fp32 losses and log-probs agree
# relative to their magnitude (a summed loss of ~100 has an ulp of ~1e-5), not bit for bit. Gradients
# and LoRA weights here are ~1e-2: an absolute 1e-5 is hundreds of ulps, and a leaked update is ~1e-3.
def assert_logprobs_close(got, want) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_fused_gradients_and_weights_equal_each_tenant_alone():
    fused, alone = make_model(), make_model()
    initial = {name: [p.detach().clone() for p in s.params] for name, s in fused.adapters.items()}
    for step in range(3):
        fused_results = fused.forward_backward_fused(DATA)
        alone_results = {name: alone.forward_backward(rows, adapter_name=name) for name, rows in DATA.items()}
        for name in DATA:
            assert fused_results[name]["loss"] == pytest.approx(alone_results[name]["loss"], rel=1e-5)
            assert fused_results[name]["loss_tokens"] == alone_results[name]["loss_tokens"]
            grads_f = [p.grad for p in fused.adapters[name].params]
            grads_a = [p.grad for p in alone.adapters[name].params]
            assert all(g is not None for g in grads_f)
            assert max_diff(grads_f, grads_a) < 1e-5, (step, name)
        for model in (fused, alone):
            for name in DATA:
                assert model.clip_grad_and_step(adapter_name=name)["stepped"]
    for name in DATA:
        assert max_diff(fused.adapters[name].params, alone.adapters[name].params) < 1e-5
        assert max_diff(fused.adapters[name].params, initial[name]) > 1e-3  # the steps really moved the weights
    # the tenant with dropout got identical masks fused and alone (per-adapter generator, own shape)
    assert fused.calculate_metric(adapter_name="alice")["loss"] == pytest.approx(
        alone.calculate_metric(adapter_name="alice")["loss"], rel=1e-5
    )


def test_each_tenant_keeps_its_own_loss_in_a_fused_pass():
    # bob: GRPO with a KL term to the base model (reference pass with his adapter off); carol: summed CE
    losses = {"bob": "GRPOLoss", "carol": "CrossEntropyLoss"}
    grpo_rows = [dict(r, advantages=float(i) - 1.0) for i, r in enumerate(DATA["bob"])]
    data = {"alice": DATA["alice"], "bob": grpo_rows, "carol": DATA["carol"]}
    fused, alone = make_model(), make_model()
    for model in (fused, alone):
        model.set_loss(losses["bob"], adapter_name="bob", beta=0.5)
        model.set_loss(losses["carol"], adapter_name="carol", reduction="sum")
    fused_results = fused.forward_backward_fused(data)
    alone_results = {name: alone.forward_backward(rows, adapter_name=name) for name, rows in data.items()}
    assert fused_results["bob"]["metrics"]["kl"] > 0  # adapter on vs off differ: the reference was really the base
    for name in data:
        assert fused_results[name]["loss"] == pytest.approx(alone_results[name]["loss"], rel=1e-5)
        assert fused_results[name]["metrics"] == pytest.approx(alone_results[name]["metrics"], rel=1e-5, abs=1e-6)
        assert (
            max_diff([p.grad for p in fused.adapters[name].params], [p.grad for p in alone.adapters[name].params])
            < 1e-5
        )
    tokens = sum(len(r["input_ids"]) - 3 for r in DATA["carol"])
    assert fused_results["carol"]["loss"] / tokens == pytest.approx(alone_results["alice"]["loss"], rel=0.5)


def test_gradient_accumulation_steps_only_on_boundaries():
    rows = make_rows(7, 4, [10])
    accumulate = MultiLoraModel(TEST_MODEL)
    single = MultiLoraModel(TEST_MODEL)
    accumulate.add_adapter_to_model("t", CONFIGS["carol"], gradient_accumulation_steps=2)
    single.add_adapter_to_model("t", CONFIGS["carol"])
    for model in (accumulate, single):
        model.set_optimizer("SGD", lr=0.5)
        with torch.no_grad():
            for p in model.adapters["t"].params:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    accumulate.forward_backward(rows[:2])
    assert accumulate.clip_grad_and_step(max_grad_norm=None) == {"stepped": False, "accumulated": 1}
    accumulate.forward_backward(rows[2:])
    assert accumulate.clip_grad_and_step(max_grad_norm=None)["stepped"]
    single.forward_backward(rows)  # equal token counts: mean of two means == mean over all
    single.clip_grad_and_step(max_grad_norm=None)
    assert max_diff(accumulate.adapters["t"].params, single.adapters["t"].params) < 1e-6


def test_forward_returns_logprobs_and_fuses_without_gradients():
    model = make_model()
    out = model.forward_fused({"alice": DATA["alice"], "carol": DATA["carol"]})
    alone = model.forward_only(DATA["alice"], adapter_name="alice")
    assert [len(x) for x in out["alice"]["logprobs"]] == [15, 11]
    for ra, rb in zip(out["alice"]["logprobs"], alone["logprobs"]):
        assert_logprobs_close(ra, rb[1:])
    assert [row[0] for row in alone["logprobs"]] == [0.0, 0.0]  # the contract: aligned with the labels
    assert all(p.grad is None for s in model.adapters.values() for p in s.params)
    logits = model.logits(DATA["carol"], adapter_name="carol")
    targets = torch.tensor(DATA["carol"][0]["input_ids"][1:])
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, targets[:, None]).squeeze(-1)
    # positions without a label (the 3-token prompt) report 0
    assert out["carol"]["logprobs"][0][:2] == [0.0, 0.0]
    assert_logprobs_close(out["carol"]["logprobs"][0][2:], logp[2:].tolist())
    assert model.calculate_metric(is_training=False, adapter_name="alice")["loss"] > 0
