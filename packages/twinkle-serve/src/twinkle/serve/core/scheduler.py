"""Runs queued work on one worker thread per backend: in `seq_id` order per model, fair across models.

Each training model (and each sampler) has its own queue, a heap keyed by `seq_id`, so its requests
run in the order the client numbered them. The worker serves the queues round-robin, one task at a
time, so one tenant's long queue does not starve another's. A task's exception fails only its own
future: `UserError` as category "user", anything else as "server" (logged with its traceback).

Work is typed (`work.py`): a `Call` ends in a `StoredAnswer` its facade encoded; the scheduler stores it
with the future unread. Fusion: a Call carrying a `PassJob` may run together with the pass jobs at
the head of other models' queues, in one `fuse_runner([item, ...])` call (the multi-LoRA engine's
fused pass). Which ones join is the planner's answer (`twinkle.model.multi_lora.planner`, built from
the config's `fusion` section) on each head's size and kind: training and forward-only jobs never share
a pass (the engine runs them as two), a batch past `fuse_max_tokens` runs alone, and a pass holds at
most `max_fuse` jobs and `group_max_tokens` padded tokens of which at most `max_padding` is padding.
Each job's `finish` then answers its own future, so one tenant's bad input fails only that tenant's
request.

Long work runs in slices (`slices.py`): a sampling call, and a pass job bigger than a fused pass may be
(the planner's group_max_tokens; `slice_runner` runs it as micro-batches of about SLICE_S), runs on a
thread of its own and hands the engine back at its step boundaries whenever other work is due: after
SLICE_S on its first turn (a short request ends within it; fresh work waits no longer than SLICE_S in all
for such first turns), then at once for fresh work (requests that
have not started: short requests are not held behind long ones), after SLICE_S for another paused job. A
paused job keeps the head of its queue (its queue's later requests still wait for it). Once every
AGED_S, the paused jobs, taking this in turns, go before fresh work for one turn, so a stream of short
requests cannot starve them; once for all of them, not for each, so that one tenant's several long
requests do not take several such turns a second from the others' short ones. `cancel`
stops a running or paused job at its next step boundary.

Work over its tenant's input-token rate waits in its queue, held (`Call.hold`), instead of being
refused; `where` tells a poll where a pending request is: running, queued behind how many, or held
by which limit for how long (Tinker's `queue_state` / `queue_state_reason`).
"""

from __future__ import annotations

import collections
import functools
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from twinkle.model.multi_lora.planner import FusionPlanner, Request
from twinkle.serve.backend import UserError
from twinkle.serve.core.futures import FutureHub
from twinkle.serve.core.slices import Cancelled, SlicedJob
from twinkle.serve.core.work import Call, PassJob, StoredAnswer
from twinkle.serve.errors import internal_error

log = logging.getLogger("twinkle.serve")
SLICE_S = 0.02  # a sliced job's turn, when only other sliced jobs wait (fresh work gets the engine at once)
AGED_S = 1.0  # paused jobs get one turn (of at least SLICE_S) before fresh work this often, taking turns
PAUSED = -(2**64)  # a paused job's heap key: the head of its queue, before any seq_id


class Scheduler:
    def __init__(
        self,
        hub: FutureHub,
        name: str = "worker",
        fuse_runner: Callable | None = None,
        on_pass: Callable[[float, int], None] | None = None,
        planner: FusionPlanner | None = None,
        slice_runner: Callable | None = None,
    ):
        """`slice_runner([item], turn_s)`: runs one pass job as micro-batches of about turn_s with step
        boundaries between them (None: pass jobs run whole); a job bigger than a fused pass goes to it."""
        self.hub = hub
        self.slice_runner = slice_runner
        self._jobs: dict[str, SlicedJob] = {}  # request id -> its sliced job, running or paused
        self.on_pass = on_pass  # (seconds, requests served) after every pass: the server's metrics
        self.fuse_runner = fuse_runner
        self.planner = planner or FusionPlanner()
        self.fused_passes = 0  # passes that served more than one model (observability, tests)
        self.fused_items: collections.Counter[str] = collections.Counter()  # API -> its requests fused
        # (monotonic end time, requests, rows) of recent passes: the operator page's passes/s and rows per pass
        self.recent_passes: deque[tuple[float, int, int]] = deque(maxlen=1024)
        self._queues: dict[str, list] = {}
        self._ready: deque[str] = deque()  # queue keys with work, in round-robin order
        self._cond = threading.Condition()
        self._tiebreak = itertools.count()
        self._running: set[str] = set()  # request ids of the pass on the worker now
        self.name = name
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"twinkle-{name}", daemon=True)
        self._thread.start()

    def submit(self, call: Call) -> None:
        """Queue `call`; it runs on the worker thread, in `seq_id` order among its queue's calls."""
        with self._cond:
            heap = self._queues.setdefault(call.queue, [])
            heapq.heappush(heap, (call.order, next(self._tiebreak), call))
            if call.queue not in self._ready:
                self._ready.append(call.queue)
            self._cond.notify()

    def pending(self, queue: str) -> int:
        with self._cond:
            return len(self._queues.get(queue, ()))

    def queues(self) -> int:
        """Queues with work waiting (one per adapter or session): an empty queue is dropped at once."""
        with self._cond:
            return len(self._queues)

    def depth(self) -> int:
        """Requests waiting, over every queue."""
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _next(self) -> list[Call] | None:
        with self._cond:
            while not (due := self._due()):
                if self._stopping:
                    return None
                held = [h.until for q in self._ready if (h := self._head(q).hold) is not None]
                # every queue's head is held by its tenant's rate (or none has work): sleep until one is due
                self._cond.wait(timeout=max(0.0, min(held) - time.monotonic()) if held else None)
            if self._stopping:
                return None
            first = self._pick(due)
            self._ready.remove(first)
            if self._head(first).job is None or self.fuse_runner is None or self._alone(self._head(first)):
                taken = [self._pop(first)]
            else:
                # other models whose next request is a due pass job may join (one request per model:
                # `first` is back in the ready list when it has more queued)
                others = [q for q in due if q != first and (h := self._head(q)).job is not None and not self._alone(h)]
                joined = self._compose(first, others)
                for queue in joined:
                    self._ready.remove(queue)
                taken = [self._pop(queue) for queue in [first, *joined]]
            self._running = {c.request_id for c in taken}
            return taken

    def _due(self) -> list[str]:
        """Queues whose head may start now, in round-robin order (a held head holds only its queue)."""
        now = time.monotonic()
        return [q for q in self._ready if self._head(q).due(now)]

    def _head(self, queue: str) -> Call:
        return self._queues[queue][0][2]

    def _pick(self, due: list[str]) -> str:
        """The queue to serve next, round-robin within each class: paused jobs that are cancelled or whose
        aged turn it is (one of them every AGED_S, given a turn of at least SLICE_S), then fresh work, then
        other paused jobs."""
        now = time.monotonic()

        def rank(queue: str) -> int:
            job = self._jobs.get(self._head(queue).request_id)
            if job is None:
                return 1
            return 0 if job.cancelled or now - job.paused_at >= AGED_S else 2

        first = min(due, key=rank)  # the first of the lowest rank, in round-robin order
        job = self._jobs.get(self._head(first).request_id)
        if job is not None:
            aged = rank(first) == 0
            job.grace_s = SLICE_S if aged else 0.0
            if aged and not job.cancelled:  # the paused jobs' turn before fresh work: the next one is AGED_S away
                for other in self._jobs.values():
                    other.paused_at = max(other.paused_at, now)
        return first

    def _alone(self, call: Call) -> bool:
        """Runs in slices, on its own: sampling, a paused job, a pass job bigger than a fused pass."""
        return call.sliced or call.request_id in self._jobs or self._big(call)

    def _big(self, call: Call) -> bool:
        if call.job is None or self.slice_runner is None:
            return False
        rows, longest, _ = call.job.shape
        return rows * longest > self.planner.group_max_tokens

    def _compose(self, first: str, others: list[str]) -> list[str]:
        """The queues among `others` whose head shares `first`'s pass: the planner's group holding
        `first`, planned on each head's kind and size (a group is one pass of the engine)."""
        if not others:
            return []
        requests = {q: Request(q, (job := _job(self._head(q))).kind, job.shape) for q in [first, *others]}
        group = next(g for g in self.planner.plan(list(requests.values())) if requests[first] in g.requests)
        return [r.tenant for r in group.requests if r.tenant != first]

    def _pop(self, queue: str) -> Call:
        heap = self._queues[queue]
        call = heapq.heappop(heap)[2]
        if heap:
            self._ready.append(queue)
        else:
            del self._queues[queue]
        return call

    def _run(self) -> None:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        while (taken := self._next()) is not None:
            started = time.perf_counter()
            with self.hub.batch():  # the pass's rows commit together, before its results are visible
                self._serve(taken)
            with self._cond:
                self._running = set()
            self.recent_passes.append((time.monotonic(), len(taken), sum(_rows(c) for c in taken)))
            if self.on_pass is not None:
                self.on_pass(time.perf_counter() - started, len(taken))
        # Paused jobs the drain did not finish: unwound (nothing of them is kept), their futures left pending
        # like queued work the drain did not reach, which a restart answers "may or may not have run".
        for job in list(self._jobs.values()):
            job.cancel("the server is stopping")
            job.turn()

    def _serve(self, taken: list[Call]) -> None:
        if len(taken) == 1:
            if self._alone(taken[0]):
                self._turn(taken[0])
            else:
                self._finish(taken[0].request_id, taken[0].run)
            return
        self.fused_passes += 1
        jobs = [_job(c) for c in taken]
        self.fused_items.update(j.api for j in jobs)
        assert self.fuse_runner is not None  # several are taken only when a fuse_runner exists
        try:
            results = self.fuse_runner([j.item for j in jobs])
        except Exception as e:
            log.exception("fused pass failed")
            results = [e] * len(taken)
        for call, job, result in zip(taken, jobs, results):
            self._finish(call.request_id, lambda finish=job.finish, result=result: finish(result))

    def _turn(self, call: Call) -> None:
        """Give `call`'s sliced job a turn (starting it on its first); paused, it goes back to the head
        of its queue; ended, its future is answered."""
        with self._cond:
            job = self._jobs.get(call.request_id)
            if job is None:
                pause = functools.partial(self._should_pause, call.queue)
                job = self._jobs[call.request_id] = SlicedJob(self._work(call), f"twinkle-{self.name}-job", pause)
                job.grace_s = SLICE_S  # its first turn: a short request ends within it, unpaused
        if job.turn():
            with self._cond:
                del self._jobs[call.request_id]
            self._finish(call.request_id, job.outcome)
            return
        with self._cond:
            job.paused_at = time.monotonic()
            heapq.heappush(self._queues.setdefault(call.queue, []), (PAUSED, next(self._tiebreak), call))
            if call.queue not in self._ready:
                self._ready.append(call.queue)

    def _work(self, call: Call) -> Callable[[], StoredAnswer]:
        """What a sliced job runs: the call, or its pass job as micro-batches."""
        if not self._big(call):
            return call.run
        job, runner = _job(call), self.slice_runner
        assert runner is not None  # _big says there is one

        def passes() -> StoredAnswer:
            try:
                (outcome,) = runner([job.item], SLICE_S)
            except Cancelled:
                raise
            except Exception as e:  # as a fused pass's failure: the job's finish answers it
                log.exception("sliced pass failed")
                outcome = e
            return job.finish(outcome)

        return passes

    def _should_pause(self, own: str, job: SlicedJob, elapsed: float) -> bool:
        """At a step boundary of the job serving queue `own`: whether other due work should run now."""
        with self._cond:
            if self._stopping:
                return False
            now = time.monotonic()
            for queue in self._ready:
                head = self._head(queue)
                if queue == own or not head.due(now):
                    continue
                other = self._jobs.get(head.request_id)
                if other is not None:  # another paused job: after a turn's length (at once if it was cancelled)
                    if other.cancelled or elapsed >= SLICE_S:
                        return True
                # fresh work: after this turn's grace; a first turn's grace (for a short request to end
                # unpaused) also ends once the work has waited SLICE_S, so new jobs' first turns in a row
                # do not add up for it
                elif elapsed >= job.grace_s or (job.turns == 1 and head.waited(now) >= SLICE_S):
                    return True
            return False

    def _finish(self, request_id: str, fn: Callable[[], StoredAnswer]) -> None:
        try:
            answer = fn()
        except Cancelled as e:
            self.hub.fail(request_id, str(e), "user")
        except UserError as e:
            self.hub.fail(request_id, str(e), "user")
        except Exception as e:
            # a fault the server names for the client (a full disk) says so; any other is logged with its
            # traceback and answered without internals (errors.internal_error)
            message = getattr(e, "client_message", None)
            if message is None:
                message = internal_error(f"request {request_id}", e, request_id)
            else:
                log.exception("request %s failed", request_id)
            self.hub.fail(request_id, message, "server")
        else:
            self.hub.complete(request_id, answer)

    def where(self, request_id: str) -> Place | None:
        """Where a pending request of this worker is (Tinker's queue_state and its reason); None if
        it is not here."""
        with self._cond:
            if request_id in self._running:
                return Place("active", f"running on {self.name}", 0, 0.0)
            if request_id in self._jobs:
                return Place(
                    "active", f"running in slices on {self.name}, paused while other work takes a turn", 0, 0.0
                )
            for heap in self._queues.values():
                mine = next((entry for entry in heap if entry[2].request_id == request_id), None)
                if mine is None:
                    continue
                ahead = [entry[2] for entry in heap if entry[:2] < mine[:2]]
                holds = [c.hold for c in [*ahead, mine[2]] if c.hold is not None]
                hold = max(holds, key=lambda h: h.until, default=None)
                starts_in = max(0.0, hold.until - time.monotonic()) if hold is not None else 0.0
                where = (
                    f"{len(ahead)} of its queue's requests before it, {len(self._queues) - 1} other "
                    f"queues taking turns on {self.name}"
                )
                if starts_in > 0 and hold is not None:
                    return Place(
                        "paused_rate_limit",
                        f"held by {hold.limit}: starts in {starts_in:.1f} s; {where}",
                        len(ahead),
                        starts_in,
                    )
                return Place("active", f"queued: {where}", len(ahead), 0.0)
        return None

    def cancel(self, request_id: str) -> Literal["dropped", "stopping", "running"] | None:
        """Cancel a request of this worker: "dropped" if it had not started (its future is the caller's
        to fail), "stopping" if it runs in slices (it stops at its next step boundary, and its future
        fails saying so), "running" if it runs whole (it finishes); None if it is not here (done)."""
        with self._cond:
            job = self._jobs.get(request_id)
            if job is not None:
                job.cancel("cancelled by the client")
                self._cond.notify()
                return "stopping"
            if request_id in self._running:
                return "running"
            for queue, heap in self._queues.items():
                kept = [entry for entry in heap if entry[2].request_id != request_id]
                if len(kept) == len(heap):
                    continue
                if kept:
                    heapq.heapify(kept)
                    self._queues[queue] = kept
                else:
                    del self._queues[queue]
                    if queue in self._ready:
                        self._ready.remove(queue)
                return "dropped"
        return None


@dataclass(frozen=True)
class Place:
    """A pending request's place: `state` as Tinker's TryAgainResponse.queue_state names it."""

    state: Literal["active", "paused_rate_limit"]  # running or queued in turn, or held by its tenant's rate
    reason: str  # for a person: what it waits for
    ahead: int  # its queue's requests that run before it
    starts_in_s: float  # how long its tenant's rate still holds it


def _rows(call: Call) -> int:
    """Rows a pass carries (native rows or Tinker datums); 0 for other work (steps, saves)."""
    return call.job.shape[0] if call.job is not None else 0


def _job(call: Call) -> PassJob:
    assert call.job is not None  # only calls carrying a pass job are composed into a fused pass
    return call.job
