"""Experiment trackers for the metric dicts a training loop already has, named as in transformers'
`TrainingArguments.report_to`: "tensorboard", "wandb", "mlflow", "trackio", a list of them, or "none".

    tracker = open_trackers("tensorboard", logging_dir="out/runs", run_name="sft", config=vars(args))
    for step in range(1, steps + 1):
        ...forward_backward, clip_grad_and_step...
        tracker.log(model.calculate_metric(), step=step)
    tracker.close()

The loop stays the user's (as with Accelerate's `log_with=` / `accelerator.log`), so this works the
same for every model engine and mode: local, torchrun, Ray and the HTTP proxies all return the same
dict. Each library is imported only when named and is an extra (`pip install 'twinkle-model[wandb]'`).
Only global rank 0 of a torchrun job writes, so one job is one run. Values that are not numbers
(None, strings) are left out, and so is `step`, which is the x axis.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

NAMES = ("tensorboard", "wandb", "mlflow", "trackio")


class Tracker(Protocol):
    def log(self, metrics: Mapping[str, object], step: int) -> None: ...

    def close(self) -> None: ...


def _require(module: str, name: str, package: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"report_to={name!r} needs the {package!r} package: pip install 'twinkle-model[{name}]'"
        ) from e


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if key == "step" or value is None or isinstance(value, (str, bytes)):
            continue
        try:
            out[key] = float(value)  # ints, floats, numpy and 0-d torch scalars
        except (TypeError, ValueError):
            continue
    return out


class TensorBoardTracker:
    """Event files under `{logging_dir}/tensorboard/{run_name}` (`tensorboard --logdir` on the parent)."""

    # ARG002: every tracker's constructor signature
    def __init__(self, logging_dir: str | os.PathLike, run_name: str, project: str, config: Mapping | None) -> None:  # noqa: ARG002
        writer_cls = _require("torch.utils.tensorboard", "tensorboard", "tensorboard").SummaryWriter
        self.log_dir = Path(logging_dir) / "tensorboard" / run_name
        self.writer = writer_cls(log_dir=str(self.log_dir))
        if config:
            self.writer.add_text("config", json.dumps(dict(config), default=str, indent=1), 0)

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        for key, value in _numbers(metrics).items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A wandb run; offline unless WANDB_MODE says otherwise (these machines have no network: upload
    later with `wandb sync {logging_dir}/wandb/offline-run-*`)."""

    def __init__(self, logging_dir: str | os.PathLike, run_name: str, project: str, config: Mapping | None) -> None:
        wandb = _require("wandb", "wandb", "wandb")
        Path(logging_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", project),
            name=run_name,
            dir=str(logging_dir),
            config=dict(config or {}),
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="create_new",
        )

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MLflowTracker:
    """An MLflow run in experiment `project`, at MLFLOW_TRACKING_URI or a file store under
    `{logging_dir}/mlruns` (`mlflow ui --backend-store-uri` that folder)."""

    _BAD_KEY_CHARS = re.compile(r"[^\w./\- ]")  # MLflow refuses e.g. the ':' of Tinker's `loss:sum`

    def __init__(self, logging_dir: str | os.PathLike, run_name: str, project: str, config: Mapping | None) -> None:
        tracking = _require("mlflow.tracking", "mlflow", "mlflow-skinny")
        self._entities = _require("mlflow.entities", "mlflow", "mlflow-skinny")
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(logging_dir) / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps the file store but asks for an explicit opt-in; a database store needs the
            # full `mlflow` package, a file store only the client.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", project)
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = [self._entities.Param(self._key(k), str(v)[:500]) for k, v in (config or {}).items()]
        if params:
            self.client.log_batch(self.run_id, params=params)

    def _key(self, key: str) -> str:
        return self._BAD_KEY_CHARS.sub("_", key)

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        now = int(time.time() * 1000)
        batch = [self._entities.Metric(self._key(k), v, now, step) for k, v in _numbers(metrics).items()]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class TrackioTracker:
    """A trackio run in project `project`, stored where trackio stores (TRACKIO_DIR, read by trackio
    at import); `trackio show --project NAME` opens its dashboard."""

    def __init__(self, logging_dir: str | os.PathLike, run_name: str, project: str, config: Mapping | None) -> None:  # noqa: ARG002 - every tracker's constructor signature
        trackio = _require("trackio", "trackio", "trackio")
        self.run = trackio.init(project=project, name=run_name, config=dict(config or {}), embed=False)

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        self.run.log(_numbers(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


_TRACKERS = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
    "trackio": TrackioTracker,
}


class Trackers:
    """Several trackers as one; also a context manager that closes them."""

    def __init__(self, trackers: Iterable[Tracker] = ()) -> None:
        self.trackers = list(trackers)

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_report_to(report_to: str | Iterable[str] | None) -> list[str]:
    """Names from "none", "tensorboard", "wandb,mlflow" or a list; unknown names raise."""
    if report_to is None:
        return []
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [n.strip().lower() for n in names if n.strip() and n.strip().lower() != "none"]
    unknown = [n for n in names if n not in _TRACKERS]
    if unknown:
        raise ValueError(f"unknown report_to {unknown}: choose from {list(NAMES)} or 'none'")
    return list(dict.fromkeys(names))


def _is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def open_trackers(
    report_to: str | Iterable[str] | None,
    *,
    logging_dir: str | os.PathLike = "runs",
    run_name: str | None = None,
    project: str = "twinkle",
    config: Mapping | None = None,
) -> Trackers:
    """The trackers `report_to` names, each starting one run called `run_name` (default: the time)."""
    names = parse_report_to(report_to)
    if not _is_main_process():
        return Trackers()
    run_name = run_name or time.strftime("%Y%m%d-%H%M%S")
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(_TRACKERS[name](logging_dir, run_name, project, config))
    except BaseException:
        Trackers(opened).close()
        raise
    return Trackers(opened)
