"""report_to: a real LoRA training loop logs `calculate_metric()` to each tracker, and each run is read
back with that library's own reader (TensorBoard's EventAccumulator, MlflowClient, `wandb leet inspect`,
trackio's SQLiteStorage) at the logged steps."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from peft import LoraConfig

from twinkle.hub import TEST_MODEL
from twinkle.metric.trackers import Trackers, open_trackers, parse_report_to
from twinkle.model import TransformersModel

STEPS = 3


@pytest.fixture
def logged(rows):
    """Three LoRA steps; each step's calculate_metric() as the loop would log it."""
    torch.manual_seed(0)
    model = TransformersModel(model_id=TEST_MODEL)
    model.add_adapter_to_model("default", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    history = []
    for _ in range(STEPS):
        model.forward_backward(inputs=rows)
        model.clip_grad_and_step()
        history.append(model.calculate_metric())
    assert [h["step"] for h in history] == [1.0, 2.0, 3.0]
    return history


def _log_all(report_to, history, tmp_path, **kw):
    with open_trackers(report_to, logging_dir=tmp_path, run_name="run1", config={"lr": 0.01}, **kw) as tracker:
        for metrics in history:
            tracker.log({**metrics, "note": "text is skipped", "missing": None}, step=int(metrics["step"]))


def test_tensorboard_event_files_hold_each_step(logged, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_all("tensorboard", logged, tmp_path)
    events = EventAccumulator(str(tmp_path / "tensorboard" / "run1"))
    events.Reload()
    assert {"loss", "grad_norm", "lr", "token_accuracy"} <= set(events.Tags()["scalars"])
    assert "note" not in events.Tags()["scalars"] and "step" not in events.Tags()["scalars"]
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([h["loss"] for h in logged], rel=1e-6)


def test_mlflow_file_store_run_holds_each_step(logged, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    history = [{**h, "loss:sum": h["loss"] * 2} for h in logged]  # Tinker-style key: ':' is not allowed
    _log_all("mlflow", history, tmp_path)
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("twinkle").experiment_id])
    assert run.info.run_name == "run1" and run.info.status == "FINISHED" and run.data.params == {"lr": "0.01"}
    for key, source in (("loss", "loss"), ("grad_norm", "grad_norm"), ("loss_sum", "loss:sum")):
        points = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert points == [(i + 1, pytest.approx(h[source], rel=1e-6)) for i, h in enumerate(history)]


def test_wandb_offline_run_holds_each_step(logged, tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default: no network here
    _log_all("wandb", logged, tmp_path)
    [run_dir] = (tmp_path / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).with_name("wandb")
    out = subprocess.run(
        [str(wandb_cli), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    history = [json.loads(line)["history"] for line in out.splitlines() if '"type":"history"' in line]
    assert [int(h["step"]["num"]) for h in history] == [1, 2, 3]
    assert [h["item"]["loss"] for h in history] == pytest.approx([m["loss"] for m in logged], rel=1e-6)
    assert all("note" not in h["item"] and "missing" not in h["item"] for h in history)


def test_trackio_local_store_holds_each_step(logged, tmp_path):
    # trackio reads TRACKIO_DIR once, at import: log and read back in a process that sets it first.
    script = textwrap.dedent("""
        import json, sys
        from twinkle.metric.trackers import open_trackers
        history = json.loads(sys.argv[1])
        with open_trackers("trackio", run_name="run1", project="twinkle-test") as tracker:
            for m in history:
                tracker.log(m, step=int(m["step"]))
        from trackio.sqlite_storage import SQLiteStorage
        print("LOGS=" + json.dumps(SQLiteStorage.get_logs("twinkle-test", "run1")))
    """)
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    out = subprocess.run(
        [sys.executable, "-c", script, json.dumps(logged)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    ).stdout
    logs = json.loads(next(line for line in out.splitlines() if line.startswith("LOGS="))[5:])
    assert [row["step"] for row in logs] == [1, 2, 3]
    assert [row["loss"] for row in logs] == pytest.approx([m["loss"] for m in logged], rel=1e-6)


def test_report_to_names_and_refusals(tmp_path):
    assert parse_report_to("none") == [] and parse_report_to(None) == []
    assert parse_report_to("tensorboard,wandb") == ["tensorboard", "wandb"]
    assert parse_report_to(["mlflow", "mlflow"]) == ["mlflow"]
    with pytest.raises(ValueError, match=r"unknown report_to \['comet'\].*tensorboard"):
        parse_report_to(["tensorboard", "comet"])
    assert open_trackers("none").trackers == []


def test_only_rank_zero_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    tracker = open_trackers("tensorboard", logging_dir=tmp_path)
    assert isinstance(tracker, Trackers) and tracker.trackers == []
    assert not (tmp_path / "tensorboard").exists()


def test_a_missing_library_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(
        ImportError,
        match=r"report_to='wandb' needs the 'wandb' package: "
        r"pip install 'twinkle-model\[wandb\]'",
    ):
        open_trackers("wandb")
