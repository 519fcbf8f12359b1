"""Phase timers for an RL step: how long sampling, scoring, training and weight sync take.

    timer = PhaseTimer()
    with timer.phase("sample"):
        ...
    timer.step_metrics()   # {"time/sample": s, ..., "time/step": s, "share/sample": ...} then resets

Thread-safe: with off-policy overlap the sampling phase runs in another thread, so phases may
overlap and their shares of the step's wall time may sum past 1 — that is the point of overlap.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

PHASES = ("sample", "score", "train", "sync")


class PhaseTimer:
    def __init__(self, clock=time.perf_counter):
        self._clock = clock
        self._lock = threading.Lock()
        self._step: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self._step_start = clock()
        self._run_start = self._step_start
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        start = self._clock()
        try:
            yield
        finally:
            self.add(name, self._clock() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._step[name] += seconds
            self.totals[name] += seconds

    def step_metrics(self) -> dict[str, float]:
        """This step's phase seconds, its wall time, each phase's share of it; starts the next step."""
        now = self._clock()
        with self._lock:
            wall = now - self._step_start
            phases = dict(self._step)
            self._step.clear()
            self._step_start = now
            self.steps += 1
        out = {f"time/{k}": v for k, v in phases.items()}
        out["time/step"] = wall
        out.update({f"share/{k}": v / wall for k, v in phases.items() if wall > 0})
        return out

    def summary(self) -> dict[str, float]:
        """Totals since construction: seconds per phase, wall seconds, shares, steps/s."""
        wall = self._clock() - self._run_start
        with self._lock:
            totals = dict(self.totals)
        out = {f"time/{k}": v for k, v in totals.items()}
        out.update({f"share/{k}": v / wall for k, v in totals.items() if wall > 0})
        out["time/wall"] = wall
        out["steps_per_s"] = self.steps / wall if wall > 0 else 0.0
        return out
