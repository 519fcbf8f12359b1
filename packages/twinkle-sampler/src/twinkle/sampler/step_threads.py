"""The intra-op thread count of decode steps, chosen by timing the steps themselves.

A decode step of a few rows is a few hundred small parallel regions (a GEMM per projection, the
attention, the KV cache's copies), and every OpenMP region ends at a barrier that waits for each
thread of its team. On a quiet machine a second thread nearly halves the GEMMs; on a loaded one it is
often not running when a region starts, and every region then waits up to a scheduler slice for it
(issue 47: a decode step of the Qwen3-0.6B-shaped model took 11-25 s with 2 threads and 1.1 s with 1,
on 2 cores at load ~22). Which count wins depends on the load of the moment, so the decode loop
measures: its first steps try each count, then it runs the faster one and times the other again as the
load changes, as often as keeps those timings to PROBE_SHARE of the time (a count 10x slower is timed
again after 10 / PROBE_SHARE steps, one 1.5x slower after 15).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Generator
from contextlib import contextmanager

import torch

PROBE_SHARE = 0.1  # of a decode's time, at most this much goes to timing the count not in use
RECENT = 3  # step times kept per count: a median of the last few, not one noisy step


class StepThreads:
    """`with StepThreads() as threads:` around a decode loop, `with threads.step():` around each step:
    the step runs at the thread count picked, and the caller's count is back when the loop ends.
    Not adaptive: every step at the caller's count."""

    def __init__(self, adaptive: bool = True):
        self.most = torch.get_num_threads()
        self.counts = [self.most, 1] if adaptive and self.most > 1 else [self.most]
        self.times: dict[int, deque[float]] = {c: deque(maxlen=RECENT) for c in self.counts}
        self.since_probe = 0.0  # seconds of steps at the best count since the other was last timed
        self.current = self.most

    def __enter__(self) -> StepThreads:
        return self

    def __exit__(self, *exc) -> None:
        self._use(self.most)

    def pick(self) -> int:
        untried = [c for c in self.counts if not self.times[c]]
        if untried:
            return untried[0]
        best = self._best()
        other = next((c for c in self.counts if c != best), best)
        return other if self.since_probe * PROBE_SHARE >= self.times[other][-1] else best

    def _use(self, count: int) -> None:
        if count != self.current:  # only on a change: setting the count also drops oneDNN's cached kernels
            torch.set_num_threads(count)  # this thread's OpenMP team (OpenMP's and MKL's counts are per thread)
            self.current = count

    @contextmanager
    def step(self) -> Generator[None]:
        count = self.pick()
        self._use(count)
        started = time.perf_counter()
        yield
        seconds = time.perf_counter() - started
        self.times[count].append(seconds)
        tried_all = all(self.times[c] for c in self.counts)
        self.since_probe = self.since_probe + seconds if tried_all and count == self._best() else 0.0

    def _best(self) -> int:
        timed = [c for c in self.counts if self.times[c]]
        return min(timed, key=lambda c: statistics.median(self.times[c])) if timed else self.most
