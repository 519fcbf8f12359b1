"""Every engine implements the one TwinkleModel contract (twinkle.model.base): same signatures, the
same accumulation rule, no implicit optimizer, refusals that name the alternative, the right
num_training_steps, and metrics that never divide by an unknown peak."""

import math

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel, TwinkleModel, num_training_steps
from twinkle.model.base import contract_mismatches
from twinkle.model.megatron.model import MegatronModel
from twinkle.model.multi_lora import MultiLoraModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


@pytest.mark.parametrize("cls", [TransformersModel, MultiLoraModel, MegatronModel])
@pytest.mark.no_float
def test_every_engine_has_the_contract_signatures(cls):
    assert issubclass(cls, TwinkleModel)
    assert contract_mismatches(cls) == []


@pytest.mark.no_float
def test_the_signature_check_catches_a_swapped_argument_order():
    class Swapped(TwinkleModel):
        def clip_grad_and_step(self, adapter_name=None, max_grad_norm=1.0): ...

    class Positional(TwinkleModel):
        def load(self, path, adapter_name=None, strict=True): ...

    assert contract_mismatches(Swapped) == [
        "Swapped.clip_grad_and_step takes (adapter_name=None, max_grad_norm=1.0); the contract: "
        "(max_grad_norm=1.0, adapter_name=None)"
    ]
    assert contract_mismatches(Positional) == [
        "Positional.load adds ['strict'] that are not keyword-only options with defaults"
    ]


def _engines():
    torch.manual_seed(0)
    t = TransformersModel(model_id=TEST_MODEL)
    t.add_adapter_to_model("default", LORA, gradient_accumulation_steps=2)
    m = MultiLoraModel(TEST_MODEL)
    m.add_adapter_to_model("default", LORA, gradient_accumulation_steps=2)
    return t, m


@pytest.mark.no_float
def test_a_missing_optimizer_is_the_same_error_on_every_engine(rows):
    for engine in _engines():
        engine.forward_backward(inputs=rows)
        with pytest.raises(ValueError, match=r"call set_optimizer\(\.\.\.\) first"):
            engine.clip_grad_and_step()
        with pytest.raises(ValueError, match=r"set_optimizer"):
            engine.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=0, num_training_steps=4)


def test_accumulation_counts_forward_backward_calls_on_every_engine(rows):
    for engine in _engines():
        engine.set_optimizer("SGD", lr=0.1)
        assert engine.clip_grad_and_step() == {"stepped": False, "accumulated": 0}
        engine.forward_backward(inputs=rows[:2])
        assert engine.clip_grad_and_step() == {"stepped": False, "accumulated": 1}
        engine.forward_backward(inputs=rows[2:])
        out = engine.clip_grad_and_step(max_grad_norm=None)  # None: not clipped, the norm still reported
        assert out["stepped"] and out["step"] == 1 and out["grad_norm"] > 0 and out["lr"] == 0.1, type(engine)


@pytest.mark.no_float
def test_engines_refuse_by_name():
    class Proxy(TwinkleModel):
        pass

    with pytest.raises(NotImplementedError, match="Proxy cannot return an autograd graph: use forward_only"):
        Proxy().forward([])
    megatron = object.__new__(MegatronModel)  # no CUDA here: only the refusals, which need no state
    with pytest.raises(
        NotImplementedError, match="MegatronModel cannot train LoRA adapters.*TransformersModel or MultiLoraModel"
    ):
        megatron.add_adapter_to_model("a", LORA)
    with pytest.raises(NotImplementedError, match="MegatronModel cannot resume training state"):
        megatron.resume_from_checkpoint("x")


def test_num_training_steps_counts_optimizer_steps():
    assert num_training_steps(10, 2) == 5
    assert num_training_steps(11, 2) == 5  # the trailing half window never steps
    assert num_training_steps(5, 2, epochs=2) == 5  # the window runs on across the epoch boundary
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive integer, got 0"):
        num_training_steps(10, 0)


def _final_lrs(rows, schedule_steps, micro_batches=8, gas=2):
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LORA, gradient_accumulation_steps=gas)
    model.set_optimizer("SGD", lr=0.1)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=0, num_training_steps=schedule_steps)
    lrs = []
    for i in range(micro_batches):
        model.forward_backward(inputs=rows[i % 4 : i % 4 + 1])
        out = model.clip_grad_and_step()
        if out["stepped"]:
            lrs.append(out["lr"])
    return lrs


def test_a_cosine_schedule_with_accumulation_2_reaches_its_end(rows):
    lrs = _final_lrs(rows, num_training_steps(8, 2))
    # 4 steps of a 4-step cosine from 0.1: 0.05 (1 + cos(pi k / 4)) after step k, the last at zero
    assert lrs == pytest.approx([0.05 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)], abs=1e-12)
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    # num_training_steps=len(dataloader), as the seed script had it, stops half way down
    assert _final_lrs(rows, 8)[-1] == pytest.approx(0.05, abs=1e-12)


def test_mfu_is_absent_without_a_peak_not_a_division_by_zero():
    from twinkle.metric import ForwardRecord, ThroughputMetric
    from twinkle.model.state import FULL_MODEL, AdapterState

    metric = ThroughputMetric(0.0)
    metric.on_forward(ForwardRecord(1.0, 10, 12, 5, 0.5, 1e6, finite=True, extras={}))
    assert metric.compute() == {"tokens_per_s": 24.0}
    # MegatronModel's metrics: its state has no measured peak (megatron builds need CUDA; the
    # metric path does not)
    megatron = object.__new__(MegatronModel)
    megatron.state = AdapterState(FULL_MODEL, [], peak_flops=0.0)
    for m in megatron.state.train_metrics:
        m.on_forward(ForwardRecord(2.0, 10, 12, 5, 0.5, 1e6, finite=True, extras={}))
    out = megatron.calculate_metric()
    assert "mfu" not in out and out["tokens_per_s"] == 24.0 and out["loss"] == 2.0 and out["step"] == 0.0


def _grads(engine):
    state = engine.adapters["default"] if isinstance(engine, MultiLoraModel) else engine.states["default"]
    params = state.params
    return [p.grad.clone() for p in params]


def test_a_custom_loss_loop_with_forward_and_backward_equals_forward_backward(rows):
    from twinkle.loss import CrossEntropyLoss

    built, custom = _engines(), _engines()
    for own, loop in zip(built, custom):
        for engine in (own, loop):
            engine.set_optimizer("SGD", lr=0.1)
        for batch in (rows[:2], rows[2:]):
            own.forward_backward(inputs=batch)
            assert loop.backward(CrossEntropyLoss()(loop.forward(batch)).loss) is True
        assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(_grads(own), _grads(loop))), type(own)
        assert loop.clip_grad_and_step()["stepped"]  # the custom micro-batches count toward the window
