"""Every run's curves, also sent to the experiment trackers the server config names (`report_to`).

The store's curve table is the one place both APIs record a run's numbers (loss, grad norm, lr, the
native API's metrics), so the trackers listen there: one tracker run per training run, named by its
model id, in a project named after its tenant, under `<data_dir>/runs/`. Opened on a run's first
point, closed when the server stops.
"""

from __future__ import annotations

import threading
from pathlib import Path

from twinkle.metric.trackers import Trackers, open_trackers, parse_report_to


class RunTrackers:
    def __init__(self, report_to: str | list[str], logging_dir: Path):
        self.report_to, self.logging_dir = parse_report_to(report_to), logging_dir
        self._open: dict[str, Trackers] = {}
        self._lock = threading.Lock()

    def log(self, model_id: str, tenant: str, step: int | None, metrics: dict[str, float]) -> None:
        if step is None or not metrics:
            return
        with self._lock:
            trackers = self._open.get(model_id)
            if trackers is None:
                trackers = self._open[model_id] = open_trackers(
                    self.report_to,
                    logging_dir=self.logging_dir,
                    run_name=model_id.replace(":", "-"),
                    project=tenant,
                    config={"model_id": model_id},
                )
        trackers.log(metrics, step)

    def close(self) -> None:
        with self._lock:
            opened, self._open = list(self._open.values()), {}
        for trackers in opened:
            trackers.close()
