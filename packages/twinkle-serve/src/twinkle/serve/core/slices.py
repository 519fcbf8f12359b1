"""Long work in slices: a request that may hold the engine for long (a decode, a training pass of
several micro-batches) runs on a thread of its own that hands the engine back to the scheduler
between its steps, so other tenants' work runs in between, and a cancelled one stops at its next step.

Exactly one of the scheduler's worker and its jobs runs at any moment: the worker gives a job a turn
(`SlicedJob.turn`) and waits until the job pauses at a step boundary or ends. The backend is still
called one operation at a time, as by one thread; a paused job's thread only keeps its place (its
Python and autograd stack) until its next turn. A step boundary is `step()`, called by the backend
between decode steps and between micro-batches; outside a job (a library caller, a test) it returns
at once. Inside one forward and backward, a long row pauses at the points of twinkle.model.preemption
(decoder layers, attention chunks), which call `pause_point` without counting a step. Whatever a step boundary lets run in between (another tenant's decode re-routes the sampler's
LoRA layers) is set back by the code that calls `step()` before its next step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Cancelled(Exception):
    """Raised at the next step boundary of a job whose request was cancelled: the work stops there."""

    def __init__(self, reason: str, steps: int):
        super().__init__(
            f"{reason} while it ran: stopped after {steps} step{'s' if steps != 1 else ''} "
            "(decode steps or micro-batches); nothing of it was kept"
        )
        self.steps = steps


_local = threading.local()


def step() -> bool:
    """A step boundary of long work: pause here if the scheduler wants the engine for other work, stop
    here (Cancelled) if the request was cancelled; -> whether it paused. A no-op outside a sliced job."""
    job = getattr(_local, "job", None)
    return job is not None and job.boundary()


class SlicedJob:
    """`fn` on a thread of its own, run turn by turn. `should_pause(seconds)`: asked at each step
    boundary with the time since this turn began; True hands the engine back to the worker."""

    def __init__(self, fn: Callable, name: str, should_pause: Callable[[SlicedJob, float], bool]):
        self.fn, self.should_pause = fn, should_pause
        self.cancelled: str | None = None  # why it was cancelled (cancel()); seen at the next step boundary
        self.steps = 0  # step boundaries passed: how far it got
        self.turns = 0  # turns given (its first turn's grace differs: core/scheduler.py)
        self.grace_s = 0.0  # this turn is not cut short for fresh work before it has run this long
        self.paused_at = 0.0  # monotonic time of its last pause (how long it has waited for a turn)
        self.done = False
        self._result, self._error = None, None
        self._cond = threading.Condition()
        self._jobs_turn = False
        self._began = 0.0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def turn(self) -> bool:
        """On the worker: let the job run until it pauses or ends; True once it has ended."""
        with self._cond:
            self.turns += 1
            self._jobs_turn, self._began = True, time.monotonic()
            if self._thread.ident is None:
                self._thread.start()
            self._cond.notify_all()
            while self._jobs_turn:
                self._cond.wait()
        return self.done

    def cancel(self, reason: str) -> None:
        self.cancelled = reason

    def outcome(self):
        """The ended job's result, or its exception raised again (on the worker, to answer its future)."""
        if self._error is not None:
            raise self._error
        return self._result

    def _main(self) -> None:
        import torch

        from twinkle.model import preemption

        torch.set_num_threads(torch.get_num_threads())  # this thread's OpenMP team sized as the worker's
        _local.job = self
        # inside one pass too: a long row's layers and attention chunks (twinkle.model.preemption)
        preemption.handler(self.pause_point)
        with self._cond:
            while not self._jobs_turn:
                self._cond.wait()
        try:
            self._result = self.fn()
        except BaseException as e:  # handed to the worker, which answers the request with it
            self._error = e
        finally:
            _local.job = None
            preemption.handler(None)
            with self._cond:
                self.done, self._jobs_turn = True, False
                self._cond.notify_all()

    def boundary(self) -> bool:
        from twinkle.model import preemption

        self.steps += 1
        return self.pause_point(preemption.pausing)

    def pause_point(self, pausing) -> bool:
        """Pause here if other work is due (True once resumed); raise Cancelled if cancelled. `pausing()`
        runs right before the wait and returns what runs once resumed (twinkle.model.preemption)."""
        paused = self.cancelled is None and self.should_pause(self, time.monotonic() - self._began)
        if paused:
            resumed = pausing()
            with self._cond:
                self._jobs_turn = False
                self._cond.notify_all()
                while not self._jobs_turn:
                    self._cond.wait()
            resumed()
        if self.cancelled is not None:
            raise Cancelled(self.cancelled, self.steps)
        return paused
