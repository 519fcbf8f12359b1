"""Short smoke runs of the RL examples on the test model: every phase of each loop runs."""

import importlib.util
import json
from pathlib import Path

import pytest

from twinkle.hub import TEST_MODEL

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_example_runs_with_metrics_and_plot(tmp_path, capsys):
    grpo = load("grpo")
    plot = tmp_path / "curve.png"
    summary = grpo.main(
        [
            "--model",
            TEST_MODEL,
            "--warm-start-steps",
            "0",
            "--steps",
            "3",
            "--prompts",
            "2",
            "--group",
            "3",
            "--max-tokens",
            "3",
            "--eval-prompts",
            "4",
            "--eval-every",
            "2",
            "--is-stats",
            "--plot",
            str(plot),
            "--report-to",
            "tensorboard",
            "--logging-dir",
            str(tmp_path / "runs"),
        ]
    )
    out = capsys.readouterr().out
    assert summary["steps"] == 3 and summary["samples_per_step"] == 6
    assert 0.0 <= summary["accuracy_start"] <= 1.0 and 0.0 <= summary["accuracy_end"] <= 1.0
    assert json.loads(out.strip().splitlines()[-1]) == summary
    assert "step 3: reward" in out and "kl" in out and "held-out reward curve:   0:" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --report-to: the same per-step metrics, read back with TensorBoard's own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    [run] = (tmp_path / "runs" / "tensorboard").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [2, 3]
    assert events.Scalars("eval/accuracy")[-1].value == pytest.approx(summary["accuracy_end"])


def test_grpo_async_example_reports_staleness_queue_and_busy_time(tmp_path, capsys):
    grpo_async = load("grpo_async")
    args = ["--model", TEST_MODEL, "--warm-start-steps", "0", "--steps", "4", "--prompts", "2", "--group", "3"]
    args += ["--eval-prompts", "4", "--eval-every", "2", "--max-staleness", "2", "--threads", "1"]
    summary = grpo_async.main([*args, "--plot", str(tmp_path / "curve.png")])
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == summary
    assert [s for s, _ in summary["curve"]] == [0, 2, 4]
    assert summary["staleness_max"] <= 2 and summary["sampler_busy_share"] > 0 and summary["trainer_busy_share"] > 0
    steps = [line for line in out.splitlines() if line.startswith("step ") and "staleness" in line]
    assert len(steps) == 4 and all(" queue " in line and "busy sampler" in line for line in steps)
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_dpo_example_runs_and_reports_both_accuracies(tmp_path, capsys):
    dpo = load("dpo")
    summary = dpo.main(
        [
            "--model",
            TEST_MODEL,
            "--warm-start-steps",
            "0",
            "--steps",
            "3",
            "--batch-pairs",
            "4",
            "--train-pairs",
            "8",
            "--eval-pairs",
            "8",
            "--eval-every",
            "2",
            "--lr",
            "1e-2",
            "--plot",
            str(tmp_path / "dpo.png"),
        ]
    )
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == summary
    # step 0: policy == reference, so no pair has a positive implicit-reward margin
    assert summary["reward_accuracy_start"] == 0.0
    assert 0.0 <= summary["preference_accuracy_end"] <= 1.0 and 0.0 <= summary["reward_accuracy_end"] <= 1.0
    assert (tmp_path / "dpo.png").read_bytes()[:4] == b"\x89PNG"


def test_dpo_overfits_four_pairs_policy_and_implicit_reward_margins_move_the_right_way():
    """The debugging check: on the pairs it trains on, chosen must overtake rejected."""
    from peft import LoraConfig

    from twinkle.model import TransformersModel
    from twinkle.template import Template

    dpo = load("dpo")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    pairs = dpo.preference_pairs("train", Template(model_id=TEST_MODEL), 4, 0, "near")
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model(
        dpo.ADAPTER, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0)
    )
    model.set_optimizer("AdamW", lr=1e-2, adapter_name=dpo.ADAPTER)
    model.set_loss("DPOLoss", adapter_name=dpo.ADAPTER, beta=0.1)
    before = dpo.evaluate(model, pairs)
    for _ in range(8):
        out = model.forward_backward(inputs=pairs, adapter_name=dpo.ADAPTER)
        model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=dpo.ADAPTER)
    after = dpo.evaluate(model, pairs)
    assert before["reward_accuracy"] == 0.0  # policy == reference: no margin yet
    assert after["reward_accuracy"] == 1.0 and out["reward_margin"] > 0 and out["loss"] < 0.69
    assert after["preference_accuracy"] >= before["preference_accuracy"]


def test_dpo_rejected_answers_are_wrong_and_of_the_asked_kind():
    dpo = load("dpo")
    rng = __import__("random").Random(0)
    assert dpo.wrong_answer("What is 8 + 36?", 44, "wrong-op", rng) == 8 - 36
    assert dpo.wrong_answer("What is 16 - 7?", 9, "wrong-op", rng) == 23
    assert dpo.wrong_answer("What is 5 - 0?", 5, "wrong-op", rng) != 5  # a+b == a-b: falls back to a near miss
    assert all(dpo.wrong_answer("What is 1 + 2?", 3, "near", rng) - 3 in (-10, -2, -1, 1, 2, 10) for _ in range(20))
    with pytest.raises(ValueError, match="rejected-answer mode"):
        dpo.preference_pairs("test", None, 1, 0, "random")


def test_gkd_example_runs_and_reports_held_out_loss_to_teacher(tmp_path, capsys):
    gkd = load("gkd")
    summary = gkd.main(
        [
            "--model",
            TEST_MODEL,
            "--teacher-warm-start",
            "0",
            "--steps",
            "2",
            "--prompts",
            "2",
            "--eval-prompts",
            "4",
            "--eval-every",
            "2",
            "--plot",
            str(tmp_path / "gkd.png"),
        ]
    )
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == summary
    # teacher == the student's base and the LoRA starts at zero: the student begins as the teacher
    assert summary["loss_start"] < 1e-6 and summary["agreement_start"] == 1.0
    assert "held-out loss_on_teacher_answers: 0:" in out
    assert (tmp_path / "gkd.png").read_bytes()[:4] == b"\x89PNG"
