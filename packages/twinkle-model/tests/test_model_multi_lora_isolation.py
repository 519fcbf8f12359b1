"""Training one tenant never touches another's weights, optimizer state, gradients or metrics
(bit-exact), whether steps interleave or share a fused pass; adapters come and go at run time."""

import gc
import weakref

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model.multi_lora import MultiLoraModel

torch.set_num_threads(2)


def rows(seed, n=2, length=12):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 800, (length,), generator=g).tolist()} for _ in range(n)]


def make_model(names=("a", "b", "c")):
    model = MultiLoraModel(TEST_MODEL)
    for rank, name in enumerate(names, start=1):
        model.add_adapter_to_model(name, LoraConfig(r=2 * rank, lora_alpha=8, target_modules="all-linear"))
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
        model.set_lr_scheduler("CosineWarmupScheduler", adapter_name=name, num_warmup_steps=1, num_training_steps=10)
    return model


def snapshot(model, name):
    state = model.adapters[name]
    optimizer = {
        i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
        for i, s in enumerate(state.optimizer.state.values())
    }
    return {
        "weights": [p.detach().clone() for p in state.params],
        "grads": [None if p.grad is None else p.grad.clone() for p in state.params],
        "optimizer": optimizer,
        "lr": state.optimizer.param_groups[0]["lr"],
        "scheduler": state.scheduler.state_dict(),
        # every metric's state but wall time: two runs of the same work never take the same seconds
        "metrics": [
            {k: v for k, v in vars(m).items() if k != "seconds"} for m in state.train_metrics + state.eval_metrics
        ],
        "counters": (state.micro_step, state.consumed_batches, state.optimizer_steps),
    }


def assert_identical(x, y):
    if isinstance(x, torch.Tensor):
        assert torch.equal(x, y)
    elif isinstance(x, dict):
        assert x.keys() == y.keys()
        for k in x:
            assert_identical(x[k], y[k])
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y)
        for u, v in zip(x, y):
            assert_identical(u, v)
    else:
        assert x == y or (x != x and y != y)  # NaN metrics compare equal to themselves here


def test_training_others_interleaved_and_fused_leaves_a_tenant_bit_exact():
    model = make_model()
    model.forward_backward(rows(0), adapter_name="b")  # b has a step of its own in flight
    model.clip_grad_and_step(adapter_name="b")
    model.forward_backward(rows(1), adapter_name="b")  # ... and gradients accumulated, not yet stepped
    before = snapshot(model, "b")
    for i in range(2):
        model.forward_backward(rows(10 + i), adapter_name="a")
        model.clip_grad_and_step(adapter_name="a")
        model.forward_backward_fused({"a": rows(20 + i), "c": rows(30 + i, n=3, length=9)})
        model.clip_grad_and_step(adapter_name="a")
        model.clip_grad_and_step(adapter_name="c")
        model.forward_fused({"a": rows(40 + i), "c": rows(41 + i)})
    model.calculate_metric(adapter_name="a")
    assert_identical(before, snapshot(model, "b"))
    # ... and b's pending step lands exactly where it would have without the others training
    reference = make_model()
    reference.forward_backward(rows(0), adapter_name="b")
    reference.clip_grad_and_step(adapter_name="b")
    reference.forward_backward(rows(1), adapter_name="b")
    model.clip_grad_and_step(adapter_name="b")
    reference.clip_grad_and_step(adapter_name="b")
    assert_identical(snapshot(model, "b"), snapshot(reference, "b"))
    assert without_timing(model.calculate_metric(adapter_name="b")) == without_timing(
        reference.calculate_metric(adapter_name="b")
    )


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in ("tokens_per_s", "mfu")}


def test_a_failing_tenant_fails_alone_in_a_fused_pass():
    model = make_model()
    before = snapshot(model, "c")
    results = model.forward_backward_fused({"a": rows(1), "c": [{"labels": [1, 2]}]}, raise_errors=False)
    assert isinstance(results["c"], ValueError) and "input_ids" in str(results["c"])
    assert results["a"]["loss"] > 0 and model.adapters["a"].params[0].grad is not None
    assert_identical(before, snapshot(model, "c"))
    with pytest.raises(ValueError, match="tenant 'c'.*input_ids"):
        model.forward_backward_fused({"a": rows(1), "c": [{"labels": [1, 2]}]})
    model.set_loss("GRPOLoss", adapter_name="c")
    with pytest.raises(ValueError, match="needs input fields \\['advantages'\\]"):
        model.forward_backward(rows(2), adapter_name="c")


def test_adapters_added_and_removed_at_run_time():
    model = make_model(("a", "b"))
    model.forward_backward(rows(0), adapter_name="a")
    model.clip_grad_and_step(adapter_name="a")
    a_before = snapshot(model, "a")
    layers_before = len(model.layers())

    model.add_adapter_to_model("late", LoraConfig(r=64, lora_alpha=8, target_modules=["k_proj"]))
    model.set_optimizer("AdamW", adapter_name="late", lr=1e-4)  # no implicit optimizer (the contract)
    late = model.adapters["late"]
    assert late.params[0].shape == (64, 96)  # its own rank, no global maximum
    model.forward_backward_fused({"late": rows(3), "b": rows(4)})
    model.clip_grad_and_step(adapter_name="late")
    refs = [weakref.ref(p) for p in late.params] + [
        weakref.ref(t) for s in late.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    ]
    assert len(refs) == 3 * len(late.params) + len(late.params)  # params, exp_avg, exp_avg_sq, step
    del late
    model.remove_adapter("late")
    gc.collect()
    assert all(r() is None for r in refs)  # weights and optimizer state are gone, not parked
    assert "late" not in model.adapter_names and len(model.layers()) == layers_before
    assert_identical(a_before, snapshot(model, "a"))

    model.remove_adapter("a")
    model.remove_adapter("b")
    assert model.layers() == []  # every Linear unwrapped again: a plain base model
    # a re-added name starts from the same seeded initial weights, whatever happened before
    fresh = make_model(("a",))
    model.add_adapter_to_model("a", LoraConfig(r=2, lora_alpha=8, target_modules="all-linear"))
    assert_identical([p.detach() for p in model.adapters["a"].params], [p.detach() for p in fresh.adapters["a"].params])


def test_bad_requests_are_named():
    model = make_model(("a", "b"))
    with pytest.raises(ValueError, match="adapter_name is required.*a, b"):
        model.forward_backward(rows(0))
    with pytest.raises(KeyError, match="no adapter named 'z'"):
        model.clip_grad_and_step(adapter_name="z")
    with pytest.raises(ValueError, match="already exists"):
        model.add_adapter_to_model("a", LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match="adapter name"):
        model.add_adapter_to_model("x.y", LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match="use_dora"):
        model.add_adapter_to_model("d", LoraConfig(r=2, target_modules="all-linear", use_dora=True))
    with pytest.raises(ValueError, match="matches no Linear"):
        model.add_adapter_to_model("d", LoraConfig(r=2, target_modules=["nope_proj"]))
    assert model.clip_grad_and_step(adapter_name="b") == {"stepped": False, "accumulated": 0}
    with pytest.raises(ValueError, match="unknown optimizer 'Adamm'"):
        model.set_optimizer("Adamm", adapter_name="a")
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        model.set_loss("nope", adapter_name="a")
    with pytest.raises(ValueError, match="field 'weights' has 3 values for 12"):
        model.forward_backward([dict(rows(0)[0], weights=[1.0, 1.0, 1.0])], adapter_name="a")
    assert model.adapters["a"].params[0].grad is None  # nothing half-done
