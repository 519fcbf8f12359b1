"""Runs queued work on one worker thread per backend: in `seq_id` order per model, fair across models.

Each training model (and each sampler) has its own queue, a heap keyed by `seq_id`, so its requests
run in the order the client numbered them. The worker serves the queues round-robin, one task at a
time, so one tenant's long queue does not starve another's. A task's exception fails only its own
future: `UserError` as category "user", anything else as "server" (logged with its traceback).

Work is typed (`work.py`): a `Call` ends in an `Answer` its facade encoded; the scheduler stores it
with the future unread. Fusion: a Call carrying a `PassJob` may run together with the pass jobs at
the head of other models' queues, in one `fuse_runner([item, ...])` call (the multi-LoRA engine's
fused pass). Which ones join is the planner's cost model (`twinkle.model.multi_lora.planner`, the
one its benchmark measures): a batch past `fuse_max_tokens` runs alone, and a pass holds at most
`group_max_tokens` padded tokens of which at most `max_padding` is padding. Each job's `finish`
then answers its own future, so one tenant's bad input fails only that tenant's request.

Work over its tenant's input-token rate waits in its queue, held (`Call.hold`), instead of being
refused; `where` tells a poll where a pending request is: running, queued behind how many, or held
by which limit for how long (Tinker's `queue_state` / `queue_state_reason`).
"""

from __future__ import annotations

import collections
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
from twinkle.serve.core.work import Answer, Call, PassJob
from twinkle.serve.errors import internal_error

log = logging.getLogger("twinkle.serve")


class Scheduler:
    def __init__(
        self,
        hub: FutureHub,
        name: str = "worker",
        fuse_runner: Callable | None = None,
        max_fuse: int = 8,
        on_pass: Callable[[float, int], None] | None = None,
        planner: FusionPlanner | None = None,
    ):
        self.hub = hub
        self.on_pass = on_pass  # (seconds, requests served) after every pass: the server's metrics
        self.fuse_runner, self.max_fuse = fuse_runner, max_fuse
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
            first = due[0]
            self._ready.remove(first)
            if self._head(first).job is None or self.fuse_runner is None:
                taken = [self._pop(first)]
            else:
                # other models whose next request is a due pass job may join (one request per model:
                # `first` is back in the ready list when it has more queued)
                others = [q for q in due[1:] if self._head(q).job is not None]
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

    def _compose(self, first: str, others: list[str]) -> list[str]:
        """The queues among `others` whose head shares `first`'s pass, by the planner's cost model.
        Every job packs as one kind: the engine's fused pass runs forward-only members in the same
        pass (they skip the backward), so only their sizes decide."""
        if not others:
            return []
        requests = {q: Request(q, inputs=(), size=_job(self._head(q)).shape) for q in [first, *others]}
        group = next(g for g in self.planner.plan(list(requests.values())) if requests[first] in g.requests)
        return [r.tenant for r in group.requests if r.tenant != first][: self.max_fuse - 1]

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

    def _serve(self, taken: list[Call]) -> None:
        if len(taken) == 1:
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

    def _finish(self, request_id: str, fn: Callable[[], Answer]) -> None:
        try:
            answer = fn()
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

    def cancel(self, request_id: str) -> bool:
        """Drop a queued task that has not started (Tinker `cancel_future`); False if it is running, done,
        or not queued here."""
        with self._cond:
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
                return True
        return False


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
