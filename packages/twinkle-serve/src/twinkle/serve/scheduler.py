"""Runs queued work on one worker thread per backend: in `seq_id` order per model, fair across models.

Each training model (and each sampler) has its own queue, a heap keyed by `seq_id`, so its requests
run in the order the client numbered them. The worker serves the queues round-robin, one task at a
time, so one tenant's long queue does not starve another's. A task's exception fails only its own
future: `UserError` as category "user", anything else as "server" (logged with its traceback).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable

from twinkle.serve.backend import UserError
from twinkle.serve.futures import FutureHub

log = logging.getLogger("twinkle.serve")


class Scheduler:
    def __init__(self, hub: FutureHub, name: str = "worker"):
        self.hub = hub
        self._queues: dict[str, list] = {}
        self._ready: deque[str] = deque()  # queue keys with work, in round-robin order
        self._cond = threading.Condition()
        self._tiebreak = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"twinkle-{name}", daemon=True)
        self._thread.start()

    def submit(self, queue: str, seq_id: int | None, request_id: str, fn: Callable[[], tuple[str, object]]) -> None:
        """`fn()` returns ("json", dict) or ("proto", bytes); it runs on the worker thread."""
        with self._cond:
            heap = self._queues.setdefault(queue, [])
            heapq.heappush(heap, (seq_id if seq_id is not None else 2**62, next(self._tiebreak), request_id, fn))
            if queue not in self._ready:
                self._ready.append(queue)
            self._cond.notify()

    def pending(self, queue: str) -> int:
        with self._cond:
            return len(self._queues.get(queue, ()))

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
            queue = self._ready.popleft()
            heap = self._queues[queue]
            _, _, request_id, fn = heapq.heappop(heap)
            if heap:
                self._ready.append(queue)
            else:
                del self._queues[queue]
            return request_id, fn

    def _run(self) -> None:
        import torch

        torch.set_num_threads(max(1, torch.get_num_threads()))
        while (item := self._next()) is not None:
            request_id, fn = item
            try:
                kind, result = fn()
            except UserError as e:
                self.hub.fail(request_id, str(e), "user")
            except Exception as e:  # noqa: BLE001 - a server bug fails this request, never the server
                log.exception("request %s failed", request_id)
                self.hub.fail(request_id, f"internal error: {type(e).__name__}: {e}", "server")
            else:
                if kind == "proto":
                    self.hub.complete_proto(request_id, result)
                else:
                    self.hub.complete_json(request_id, result)
