"""The intra-op thread count of decode steps, chosen by timing the steps themselves.

A decode step of a few rows is a few hundred small parallel regions (a GEMM per projection, the
attention, the KV cache's copies), and every OpenMP region ends at a barrier that waits for each
thread of its team. On a quiet machine a second thread nearly halves the GEMMs; on a loaded one it is
often not running when a region starts, and every region then waits up to a scheduler slice for it
(issue 47: a decode step of the Qwen3-0.6B-shaped model took 11-25 s with 2 threads and 1.1 s with 1,
on 2 cores at load ~22). Which count wins depends on the load of the moment, so the decode loop
measures: its first steps try each count, then it runs the faster one and times the other again as the
load changes, as often as keeps those timings to PROBE_SHARE of the time (a count 10x slower is timed
again after 10 / PROBE_SHARE steps, one 1.5x slower after 15). The timings outlive a decode (a
sampler keeps one StepTimes for all its decodes: the load outlives a call), and a decode's prefill runs at
the count its steps found faster (at load ~15 a 128-token prefill took 35-49 s at 2 threads, 3 s at 1).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PROBE_SHARE = 0.1  # of a decode's time, at most this much goes to timing the count not in use
RECENT = 3  # step times kept per count: a median of the last few, not one noisy step


@dataclass
class StepTimes:
    """Recent decode step times per thread count, and the seconds of steps at the faster count since
    the other was last timed."""

    times: dict[int, deque[float]] = field(default_factory=dict)
    since_probe: float = 0.0


class StepThreads:
    """`with StepThreads(times) as threads:` around a decode, `with threads.step():` around each step:
    the step runs at the thread count picked, and the caller's count is back when the decode ends.
    Not adaptive: every step at the caller's count."""

    def __init__(self, times: StepTimes | None = None, adaptive: bool = True):
        self.most = torch.get_num_threads()
        self.counts = [self.most, 1] if adaptive and self.most > 1 else [self.most]
        self.state = times if times is not None else StepTimes()
        self.times = self.state.times
        for count in self.counts:
            self.times.setdefault(count, deque(maxlen=RECENT))

    def __enter__(self) -> StepThreads:
        return self

    def __exit__(self, *exc) -> None:
        _use(self.most)

    def use_faster(self) -> None:
        """Run what follows (a prefill) at the count the steps found faster, once each count was timed."""
        if all(self.times[c] for c in self.counts):
            _use(self._best())

    def pick(self) -> int:
        untried = [c for c in self.counts if not self.times[c]]
        if untried:
            return untried[0]
        best = self._best()
        other = next((c for c in self.counts if c != best), best)
        return other if self.state.since_probe * PROBE_SHARE >= self.times[other][-1] else best

    @contextmanager
    def step(self) -> Generator[None]:
        count = self.pick()
        _use(count)
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.times[count].append(seconds)
        tried_all = all(self.times[c] for c in self.counts)
        self.state.since_probe = self.state.since_probe + seconds if tried_all and count == self._best() else 0.0

    def _best(self) -> int:
        timed = [c for c in self.counts if self.times[c]]
        return min(timed, key=lambda c: statistics.median(self.times[c])) if timed else self.most


def _use(count: int) -> None:
    if count != torch.get_num_threads():  # only on a change: setting the count also drops oneDNN's cached kernels
        torch.set_num_threads(count)  # this thread's OpenMP team (OpenMP's and MKL's counts are per thread)
