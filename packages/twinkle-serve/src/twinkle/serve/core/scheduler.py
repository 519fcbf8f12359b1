"""Runs queued work on one worker thread per backend: in `seq_id` order per model, fair across models.

Each training model (and each sampler) has its own queue, a heap keyed by `seq_id`, so its requests
run in the order the client numbered them. The worker serves the queues round-robin, one task at a
time, so one tenant's long queue does not starve another's. A task's exception fails only its own
future: `UserError` as category "user", anything else as "server" (logged with its traceback).

Fusion: a task submitted with `fuse=(item, finish)` may run together with the fusable tasks at the
head of other models' queues, in one `fuse_runner([item, ...])` call (the multi-LoRA engine's fused
pass); each task's `finish(result)` then completes its own future, so one tenant's bad input fails
only that tenant's request.
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

from twinkle.serve.backend import UserError
from twinkle.serve.core.futures import FutureHub

log = logging.getLogger("twinkle.serve")


class Scheduler:
    def __init__(
        self,
        hub: FutureHub,
        name: str = "worker",
        fuse_runner: Callable | None = None,
        max_fuse: int = 8,
        on_pass: Callable[[float, int], None] | None = None,
    ):
        self.hub = hub
        self.on_pass = on_pass  # (seconds, requests served) after every pass: the server's metrics
        self.fuse_runner, self.max_fuse = fuse_runner, max_fuse
        self.fused_passes = 0  # passes that served more than one model (observability, tests)
        self.fused_items: collections.Counter[str] = collections.Counter()  # item type -> requests fused
        # (monotonic end time, requests, rows) of recent passes: the operator page's passes/s and rows per pass
        self.recent_passes: deque[tuple[float, int, int]] = deque(maxlen=1024)
        self._queues: dict[str, list] = {}
        self._ready: deque[str] = deque()  # queue keys with work, in round-robin order
        self._cond = threading.Condition()
        self._tiebreak = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"twinkle-{name}", daemon=True)
        self._thread.start()

    def submit(
        self,
        queue: str,
        seq_id: int | None,
        request_id: str,
        fn: Callable[[], tuple[str, object]],
        fuse: tuple | None = None,
    ) -> None:
        """`fn()` returns ("json", dict) or ("proto", bytes); it runs on the worker thread."""
        with self._cond:
            heap = self._queues.setdefault(queue, [])
            heapq.heappush(heap, (seq_id if seq_id is not None else 2**62, next(self._tiebreak), request_id, fn, fuse))
            if queue not in self._ready:
                self._ready.append(queue)
            self._cond.notify()

    def pending(self, queue: str) -> int:
        with self._cond:
            return len(self._queues.get(queue, ()))

    def depth(self) -> int:
        """Requests waiting, over every queue."""
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _next(self):
        with self._cond:
            while not self._ready and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            first = self._ready.popleft()
            taken = [self._pop(first)]
            if taken[0][2] is not None and self.fuse_runner is not None:
                # other models whose next request is fusable join this pass (one request per model:
                # `first` is back in the ready list when it has more queued)
                for queue in list(self._ready):
                    if len(taken) >= self.max_fuse:
                        break
                    if queue != first and self._queues[queue][0][4] is not None:
                        self._ready.remove(queue)
                        taken.append(self._pop(queue))
            return taken

    def _pop(self, queue: str):
        heap = self._queues[queue]
        _, _, request_id, fn, fuse = heapq.heappop(heap)
        if heap:
            self._ready.append(queue)
        else:
            del self._queues[queue]
        return request_id, fn, fuse

    def _run(self) -> None:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        while (taken := self._next()) is not None:
            started = time.perf_counter()
            self._serve(taken)
            self.recent_passes.append((time.monotonic(), len(taken), sum(_rows(fuse) for _, _, fuse in taken)))
            if self.on_pass is not None:
                self.on_pass(time.perf_counter() - started, len(taken))

    def _serve(self, taken: list) -> None:
        if len(taken) == 1:
            request_id, fn, _ = taken[0]
            self._finish(request_id, fn)
            return
        self.fused_passes += 1
        self.fused_items.update(type(fuse[0]).__name__ for _, _, fuse in taken)
        assert self.fuse_runner is not None  # several are taken only when a fuse_runner exists
        try:
            results = self.fuse_runner([fuse[0] for _, _, fuse in taken])
        except Exception as e:  # noqa: BLE001 - the whole pass failed: fail each request, keep serving
            log.exception("fused pass failed")
            results = [e] * len(taken)
        for (request_id, _, fuse), result in zip(taken, results):
            self._finish(request_id, lambda: fuse[1](result))

    def _finish(self, request_id: str, fn) -> None:
        try:
            kind, result = fn()
        except UserError as e:
            self.hub.fail(request_id, str(e), "user")
        except Exception as e:  # noqa: BLE001 - a server bug fails this request, never the server
            log.exception("request %s failed", request_id)
            # a fault the server names for the client (a full disk) says so, not "internal error"
            message = getattr(e, "client_message", None) or f"internal error: {type(e).__name__}: {e}"
            self.hub.fail(request_id, message, "server")
        else:
            if kind == "proto":
                self.hub.complete_proto(request_id, result)
            else:
                self.hub.complete_json(request_id, result)

    def cancel(self, request_id: str) -> bool:
        """Drop a queued task that has not started (Tinker `cancel_future`); False if it is running, done,
        or not queued here."""
        with self._cond:
            for queue, heap in self._queues.items():
                kept = [entry for entry in heap if entry[2] != request_id]
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


def _rows(fuse: tuple | None) -> int:
    """Rows a fusable pass item carries (native rows or Tinker datums); 0 for other work (steps, saves)."""
    item = fuse[0] if fuse else None
    return len(getattr(item, "rows", None) or getattr(item, "data", None) or ())
