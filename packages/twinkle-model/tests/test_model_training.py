"""TransformersModel on the embedded test model: the training API, accumulation, bad input."""

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.loss import Loss
from twinkle.model import TransformersModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def lora_model(gas=1, lr=1e-2, name="default", seed=0):
    torch.manual_seed(seed)
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model(name, LORA, gradient_accumulation_steps=gas)
    m.set_optimizer("AdamW", lr=lr)
    return m


def adapter_weights(m, name="default"):
    return {n: p.detach().clone() for n, p in m.states[name].named_params()}


def test_lora_training_reduces_loss_and_reports_metrics(rows):
    m = lora_model(lr=2e-2)
    m.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2, num_training_steps=12)
    losses = []
    for _ in range(12):
        losses.append(m.forward_backward(inputs=rows)["loss"])
        assert m.clip_grad_and_step()["stepped"]
    assert losses[-1] < losses[0] - 0.5
    metrics = m.calculate_metric(is_training=True)
    assert metrics["step"] == 12 and metrics["skipped_steps"] == 0
    assert 0 <= metrics["token_accuracy"] <= 1 and metrics["grad_norm"] > 0
    assert metrics["tokens_per_s"] > 0 and 0 < metrics["mfu"] < 1
    assert metrics["lr"] == pytest.approx(m.states["default"].scheduler.get_last_lr()[0])
    assert m.calculate_metric().get("loss") != metrics["loss"]  # reset after reading


def test_gradient_accumulation_steps_only_on_boundaries_and_averages(rows):
    m = lora_model(gas=2)
    before = adapter_weights(m)
    m.forward_backward(inputs=rows[:2])
    assert m.clip_grad_and_step() == {"stepped": False, "accumulated": 1}
    assert all(torch.equal(before[n], p) for n, p in m.states["default"].named_params())
    m.forward_backward(inputs=rows[2:])
    accumulated = {n: p.grad.clone() for n, p in m.states["default"].named_params() if p.grad is not None}

    # the same two micro-batches by hand: mean of the per-micro-batch gradients
    ref = lora_model(gas=1)
    expected = {}
    for half in (rows[:2], rows[2:]):
        ref.forward_backward(inputs=half)
        for n, p in ref.states["default"].named_params():
            if p.grad is not None:
                expected[n] = expected.get(n, 0) + p.grad.clone() / 2
                p.grad = None
        ref.states["default"].micro_step = 0
    assert accumulated.keys() == expected.keys() and accumulated
    for n in accumulated:
        torch.testing.assert_close(accumulated[n], expected[n])
    assert m.clip_grad_and_step()["stepped"]
    assert any(not torch.equal(before[n], p) for n, p in m.states["default"].named_params())


@pytest.mark.no_float
def test_out_of_vocab_id_raises_before_the_model_runs(rows):
    m = lora_model()
    calls = []
    m.hf_model.register_forward_pre_hook(lambda *a: calls.append(1))
    bad = [dict(rows[0]), rows[1]]
    bad[0]["input_ids"] = [*bad[0]["input_ids"][:3], m.vocab_size + 7, *bad[0]["input_ids"][4:]]
    with pytest.raises(ValueError, match=rf"token id {m.vocab_size + 7} .*vocabulary of size {m.vocab_size}"):
        m.forward_backward(inputs=bad)
    with pytest.raises(ValueError, match="token id -3"):
        m.forward_backward(inputs=[{"input_ids": [1, 2, -3], "labels": [1, 2, 3]}])
    assert calls == []


class _NaNOnSecondCall(Loss):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def per_token(self, ctx):
        self.calls += 1
        out = -ctx.logps_B_T
        return out * float("nan") if self.calls == 2 else out


def test_nonfinite_loss_skips_the_step_and_leaves_weights_and_optimizer_untouched(rows):
    m = lora_model(gas=1)
    m.set_loss(_NaNOnSecondCall)
    m.forward_backward(inputs=rows)
    m.clip_grad_and_step()
    weights = adapter_weights(m)
    opt_state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in m.states["default"].optimizer.state.items()}
    out = m.forward_backward(inputs=rows)
    assert out["loss"] != out["loss"]  # NaN reported
    assert m.clip_grad_and_step()["skipped"]
    assert all(torch.equal(weights[n], p) for n, p in m.states["default"].named_params())
    for k, v in m.states["default"].optimizer.state.items():
        assert all(torch.equal(vv, opt_state[k][kk]) for kk, vv in v.items())
    assert all(p.grad is None for p in m.states["default"].params)
    metrics = m.calculate_metric()
    assert metrics["skipped_steps"] == 1 and metrics["nonfinite_losses"] == 1 and metrics["step"] == 1
    m.forward_backward(inputs=rows)  # training continues afterwards
    assert m.clip_grad_and_step()["stepped"]


@pytest.mark.no_float
def test_unknown_optimizer_and_scheduler_names_list_the_registered_ones():
    m = TransformersModel(model_id=TEST_MODEL)
    with pytest.raises(ValueError, match="unknown optimizer 'Adamm'.*AdamW.*SGD"):
        m.set_optimizer("Adamm", lr=1e-3)
    m.set_optimizer("SGD", lr=1e-3)
    with pytest.raises(ValueError, match="unknown lr scheduler 'cos'.*CosineWarmupScheduler.*LinearWarmupScheduler"):
        m.set_lr_scheduler("cos")
    with pytest.raises(ValueError, match="unknown loss 'xent'.*CrossEntropyLoss"):
        m.set_loss("xent")


def test_full_model_optimizer_has_decay_and_no_decay_groups():
    m = TransformersModel(model_id=TEST_MODEL)
    m.set_optimizer("AdamW", lr=1e-3, weight_decay=0.1)
    decay, no_decay = m.states[""].optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    total = sum(p.numel() for p in m.hf_model.parameters())
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == total


def test_schedulers_follow_their_formulas():
    from twinkle.model.optim import CosineWarmupScheduler, LinearWarmupScheduler

    p = torch.nn.Parameter(torch.zeros(1))
    for cls, expect in [
        # transformers' schedules: warmup lr·step/warmup (Twinkle's own used (step+1)/(warmup+1))
        (CosineWarmupScheduler, [0.0, 0.5, 1.0, 0.5 * (1 + torch.cos(torch.tensor(torch.pi / 4)).item()), 0.5]),
        (LinearWarmupScheduler, [0.0, 0.5, 1.0, 0.75, 0.5]),
    ]:
        opt = torch.optim.SGD([p], lr=1.0)
        sched = cls(opt, num_warmup_steps=2, num_training_steps=6)
        lrs = []
        for _ in range(5):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert lrs == pytest.approx(expect)


def test_several_adapters_keep_separate_state(rows):
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("alpha", LORA, gradient_accumulation_steps=1)
    m.add_adapter_to_model(
        "beta", LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]), gradient_accumulation_steps=2
    )
    m.set_optimizer("AdamW", adapter_name="alpha", lr=1e-2)
    m.set_optimizer("SGD", adapter_name="beta", lr=1e-1)
    with pytest.raises(ValueError, match=r"several adapters exist \['alpha', 'beta'\]"):
        m.forward_backward(inputs=rows)
    with pytest.raises(ValueError, match="unknown adapter 'c'"):
        m.forward_backward(inputs=rows, adapter_name="c")
    b_before = adapter_weights(m, "beta")
    m.forward_backward(inputs=rows, adapter_name="beta")  # half an accumulation window for b
    m.forward_backward(inputs=rows, adapter_name="alpha")
    assert m.clip_grad_and_step(adapter_name="alpha")["stepped"]
    assert m.clip_grad_and_step(adapter_name="beta") == {"stepped": False, "accumulated": 1}
    assert all(torch.equal(b_before[n], p) for n, p in m.states["beta"].named_params())
    assert all(p.grad is not None for n, p in m.states["beta"].named_params() if "lora_B" in n)
    m.forward_backward(inputs=rows, adapter_name="beta")
    assert m.clip_grad_and_step(adapter_name="beta")["stepped"]
    assert type(m.states["alpha"].optimizer).__name__ == "AdamW" and type(m.states["beta"].optimizer).__name__ == "SGD"
    assert (
        m.calculate_metric(adapter_name="alpha")["step"] == 1 and m.calculate_metric(adapter_name="beta")["step"] == 1
    )


def test_forward_only_logprobs_match_a_direct_computation(rows):
    m = lora_model()
    out = m.forward_only(inputs=rows[:2])
    for row, logps in zip(rows[:2], out["logprobs"]):
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            ref = torch.log_softmax(m.peft_model(input_ids=ids).logits[0, :-1], -1)
        expected = ref.gather(-1, ids[0, 1:, None]).squeeze(-1)
        expected = torch.where(torch.tensor(row["labels"][1:]) == -100, 0.0, expected)
        assert len(logps) == len(row["input_ids"]) and logps[0] == 0.0
        torch.testing.assert_close(torch.tensor(logps[1:]), expected, rtol=1e-5, atol=1e-5)
    assert "loss" in m.calculate_metric(is_training=False)


def test_dpo_reference_is_the_base_with_adapter_disabled(rows):
    m = lora_model()
    m.set_loss("dpo", beta=0.1)
    # LoRA B starts at zero: policy == reference, so the margin is 0 and the loss is log 2
    out = m.forward_backward(inputs=rows)
    assert out["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-6)
    m.clip_grad_and_step()
    assert m.forward_backward(inputs=rows)["loss"] != pytest.approx(out["loss"], abs=1e-6)


def test_rl_loss_inputs_travel_with_the_rows(rows):
    m = lora_model()
    m.set_loss("ppo")
    logps = m.forward_only(inputs=rows)["logprobs"]
    rl_rows = [dict(r, logprobs=lp, advantages=1.0 if i % 2 else -1.0) for i, (r, lp) in enumerate(zip(rows, logps))]
    out = m.forward_backward(inputs=rl_rows)
    # on-policy: ratio 1 everywhere, so the loss is -mean(A) over loss tokens
    n = [sum(1 for x in r["labels"][1:] if x != -100) for r in rows]
    expected = -sum((1.0 if i % 2 else -1.0) * k for i, k in enumerate(n)) / sum(n)
    assert out["loss"] == pytest.approx(expected, abs=1e-5)
    assert out["clip_fraction"] == 0.0


def test_scheduler_names_are_transformers_get_scheduler_family():
    from transformers import get_scheduler

    from twinkle.model.optim import resolve_scheduler

    def lrs(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, out = make(opt), []
        for _ in range(8):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    for ours, theirs, extra in [
        ("cosine", "cosine", {}),
        ("linear", "linear", {}),
        ("constant_with_warmup", "constant_with_warmup", {}),
        ("CosineWarmupScheduler", "cosine_with_min_lr", {"min_lr_ratio": 0.1}),
    ]:
        mine = lrs(
            lambda o, ours=ours, extra=extra: resolve_scheduler(ours)(
                o, num_warmup_steps=3, num_training_steps=7, **extra
            )
        )
        kwargs = {"min_lr_rate": 0.1} if extra else None
        reference = lrs(
            lambda o, theirs=theirs, kwargs=kwargs: get_scheduler(
                theirs, o, num_warmup_steps=3, num_training_steps=7, scheduler_specific_kwargs=kwargs
            )
        )
        assert mine == reference, ours
    assert lrs(lambda o: resolve_scheduler("LinearWarmupScheduler")(o, 2, 6, min_lr_ratio=0.5))[2:7] == pytest.approx(
        [1.0, 0.875, 0.75, 0.625, 0.5]
    )
