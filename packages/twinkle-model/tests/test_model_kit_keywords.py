"""twinkle-kit's keywords on TransformersModel (twinkle.model.kit, twinkle.data_format.loss_inputs): each one
does what its name says, checked against the call it stands for, and a keyword that cannot be honoured
is refused by name."""

import json
import random

import pytest
import torch
from peft import LoraConfig

from twinkle.data_format.loss_inputs import merge_loss_inputs
from twinkle.hub import TEST_MODEL
from twinkle.model import TransformersModel

LORA = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")


def make_rows(n, seed=0):
    """n encoded rows of 8-13 tokens whose first 3 are a prompt (no loss)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randrange(1, 800) for _ in range(rng.randint(8, 13))]
        out.append({"input_ids": ids, "labels": [-100, -100, -100, *ids[3:]]})
    return out


def _model(lr=1e-2, gas=1):
    torch.manual_seed(0)
    m = TransformersModel(model_id=TEST_MODEL)
    m.add_adapter_to_model("default", LORA, gradient_accumulation_steps=gas)
    m.set_optimizer("AdamW", lr=lr)
    return m


def test_loss_inputs_land_on_the_completion_positions():
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]
    out = merge_loss_inputs(rows, old_logps=[[-0.5, -1.5], [-2.0, -3.0]], advantages=[1.0, [0.25, 0.75]])
    assert out[0]["logprobs"] == [0.0, 0.0, -0.5, -1.5] and out[0]["advantages"] == 1.0
    assert out[1]["logprobs"] == [0.0, -2.0, -3.0] and out[1]["advantages"] == [0.0, 0.25, 0.75]
    ref = merge_loss_inputs(rows, ref_outputs={"loss": 1.0, "logprobs": [[0.0, -1, -2, -3], [0.0, -4, -5]]})
    assert ref[1]["ref_logprobs"] == [0.0, -4.0, -5.0] and "ref_logprobs" not in rows[1]
    assert merge_loss_inputs(rows) is rows


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"old_logps": [[-0.5], [-2.0, -3.0]]}, r"old_logps: row 0 has 1 values but 2 completion tokens"),
        ({"advantages": [1.0]}, r"advantages must have one entry per row \(2 rows\)"),
        ({"ref_outputs": [[0.0]]}, r"ref_outputs must be what forward_only returned"),
    ],
)
def test_loss_inputs_that_do_not_fit_are_refused(kwargs, message):
    rows = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}]
    with pytest.raises(ValueError, match=message):
        merge_loss_inputs(rows, **kwargs)


def test_advantages_keyword_trains_as_the_field_in_the_rows():
    rows = make_rows(4)
    advantages = [1.0, -1.0, 0.5, -0.5]
    a, b = _model(), _model()
    a.set_loss("GRPOLoss")
    b.set_loss("GRPOLoss")
    out_a = a.forward_backward(inputs=rows, advantages=advantages)
    out_b = b.forward_backward(inputs=[{**r, "advantages": v} for r, v in zip(rows, advantages)])
    assert out_a["loss"] == pytest.approx(out_b["loss"], rel=1e-6)
    for p, q in zip(a.states["default"].params, b.states["default"].params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8)


def test_micro_batch_size_gives_the_whole_batch_gradient_and_counts_one_micro_batch():
    rows = make_rows(6, seed=3)
    whole, micro = _model(gas=2), _model(gas=2)
    out_whole = whole.forward_backward(inputs=rows)
    out_micro = micro.forward_backward(inputs=rows, micro_batch_size=4)
    assert out_micro["loss"] == pytest.approx(out_whole["loss"], rel=1e-5)
    for p, q in zip(whole.states["default"].params, micro.states["default"].params):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7)
    assert micro.clip_grad_and_step() == {"stepped": False, "accumulated": 1}


def test_forward_only_disable_lora_is_the_base_model():
    rows = make_rows(2, seed=5)
    m = _model(lr=5e-2)
    base = m.forward_only(inputs=rows)["logprobs"]
    for _ in range(3):
        m.forward_backward(inputs=rows)
        m.clip_grad_and_step()
    assert m.forward_only(inputs=rows)["logprobs"] != base
    torch.testing.assert_close(
        torch.tensor(m.forward_only(inputs=rows, disable_lora=True)["logprobs"][0]), torch.tensor(base[0])
    )


def test_save_output_dir_optimizer_and_consumed_samples_then_resume(tmp_path):
    rows = make_rows(4)
    m = _model()
    m.forward_backward(inputs=rows)
    m.clip_grad_and_step()
    where = m.save("ckpt", output_dir=str(tmp_path / "out"), save_optimizer=True, consumed_train_samples=12)
    assert where == str(tmp_path / "out" / "ckpt")
    counters = json.loads((tmp_path / "out" / "ckpt" / "training_state" / "state.json").read_text())["counters"]
    assert counters["consumed_train_samples"] == 12
    fresh = _model()
    progress = fresh.resume_from_checkpoint(where)
    assert (progress["cur_step"], progress["consumed_train_samples"], progress["optimizer_steps"]) == (1, 12, 1)
    only = _model()
    assert only.resume_from_checkpoint(where, resume_only_model=True)["consumed_train_samples"] == 12
    assert only.states["default"].optimizer_steps == 0  # weights only: the counters are reported, not restored
    with pytest.raises(ValueError, match="save_training_state=True and save_optimizer=False"):
        m.save(str(tmp_path / "x"), save_training_state=True, save_optimizer=False)


def test_train_configs_optimizer_group_and_task():
    m = _model(lr=3e-4, gas=2)
    text = m.get_train_configs()
    trainable = sum(p.numel() for p in m.states["default"].params)
    assert (
        f"Trainable params: {trainable:,d}" in text and "Optimizer: AdamW" in text and "Learning rate: 0.0003" in text
    )
    group = m.optimizer_group["default"]
    assert group.cur_step == 0 and m.model is m.hf_model
    for _ in range(2):
        m.forward_backward(inputs=make_rows(2))
        m.clip_grad_and_step()
    assert group.cur_step == 1  # a live view: the loop holds it and reads it after each step
    m.forward_only(inputs=make_rows(2))
    assert m.calculate_loss() == m.last_eval_loss is not None  # twinkle-kit's evaluate loop calls it bare
    with pytest.raises(NotImplementedError, match="task='fused_lm_ce' is not offered"):
        m.forward_backward(inputs=make_rows(2), task="fused_lm_ce")


def test_dpo_sft_weight_and_reference_free_by_hand():
    import torch.nn.functional as F

    from twinkle.loss import DPOLoss, LossContext

    torch.manual_seed(1)
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, -100], [3, 4, 0]])  # a (chosen, rejected) pair
    ref = torch.randn(2, 3)
    ctx = LossContext.from_logits(logits, targets, ref_logprobs=ref)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    mask = (targets != -100).float()
    s_c, s_r = (logp * mask).sum(1)
    r_c, r_r = (ref * mask).sum(1)
    beta, w = 0.5, 2.0
    expected = -F.logsigmoid(beta * ((s_c - r_c) - (s_r - r_r))) + w * (-s_c / 2)
    out = DPOLoss(beta=beta, sft_weight=w)(ctx)
    torch.testing.assert_close(out.loss, expected, rtol=1e-5, atol=1e-6)
    assert out.metrics["logps_chosen"] == pytest.approx(float(s_c), rel=1e-5)
    free = DPOLoss(beta=beta, reference_free=True)(LossContext.from_logits(logits, targets))
    torch.testing.assert_close(free.loss, -F.logsigmoid(beta * (s_c - s_r)), rtol=1e-5, atol=1e-6)
    assert not DPOLoss(reference_free=True).needs_reference({})


def test_grpo_epsilon_clips_both_sides_alike():
    from twinkle.loss import GRPOLoss

    loss = GRPOLoss(epsilon=0.1)
    assert (loss.epsilon_low, loss.epsilon_high) == (0.1, 0.1)
    with pytest.raises(ValueError, match="epsilon or epsilon_low / epsilon_high, not both"):
        GRPOLoss(epsilon_low=0.3, epsilon=0.1)


def test_kit_metrics_report_what_they_measured():
    from twinkle.metric import METRICS, CompletionRewardMetric, DPOMetric, ForwardRecord, GRPOMetric

    rollout = CompletionRewardMetric()
    assert rollout.calculate() == {}  # nothing measured: nothing reported
    rollout.accumulate(None, None, completion_lengths=[4, 6], rewards={"total": [1.0, 0.0, 2.0]})
    assert rollout.calculate() == {
        "train/total_reward": 1.0,
        "train/total_reward_std": 1.0,
        "train/completion_length": 5.0,
    }
    dpo, grpo = METRICS.create("DPOMetric", beta=0.1), METRICS.create("GRPOMetric")
    assert isinstance(dpo, DPOMetric) and isinstance(grpo, GRPOMetric)
    for margin in (0.2, 0.4):
        record = ForwardRecord(1.0, 4, 8, 1, 0.1, 1.0, extras={"reward_margin": margin, "clip_fraction": 0.5})
        dpo.on_forward(record)
        grpo.on_forward(record)
    assert dpo.compute() == {"rewards/margins": pytest.approx(0.3)} and grpo.compute() == {"clip_ratio": 0.5}


def test_cpo_and_orpo_by_hand():
    import math

    import torch.nn.functional as F

    from twinkle.loss import LOSSES, LossContext

    torch.manual_seed(2)
    logits = torch.randn(2, 4, 6)
    targets = torch.tensor([[1, 2, 3, -100], [4, 5, -100, -100]])
    ctx = LossContext.from_logits(logits, targets)
    logp = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    s = (logp * (targets != -100)).sum(1)
    a_c, a_r = s[0] / 3, s[1] / 2
    cpo = LOSSES.create("CPOLoss", beta=0.5, bc_coef=2.0)(ctx).loss
    torch.testing.assert_close(cpo, -F.logsigmoid(0.5 * (s[0] - s[1])) - 2.0 * a_c, rtol=1e-5, atol=1e-6)

    def odds(a):
        return a - math.log(1 - math.exp(float(a)))

    orpo = LOSSES.create("orpo", lambda_orpo=0.3)(ctx).loss
    expected = -a_c - 0.3 * F.logsigmoid(torch.as_tensor(float(odds(a_c) - odds(a_r))))
    torch.testing.assert_close(orpo, expected.to(orpo.dtype), rtol=1e-5, atol=1e-6)


def test_kernel_and_device_probes_refuse_what_is_not_here():
    from twinkle.kernel import kernelize, liger_builtin
    from twinkle.utils.framework import Torch

    model = object()
    assert kernelize(model, {}) is model and Torch.is_npu_available() is False
    with pytest.raises(NotImplementedError, match="Liger kernels are not offered"):
        liger_builtin(model)
    with pytest.raises(NotImplementedError, match="kernelize takes an empty mapping"):
        kernelize(model, {"rms_norm": object()})
