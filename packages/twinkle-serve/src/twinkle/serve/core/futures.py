"""Futures: every submission gets a request id; `retrieve_future` long-polls it.

Results are written to SQLite before the waiting poll is woken, so a result a client has seen
survives a restart. Finished futures are kept `keep_s` (the config's futures_keep_hours), then pruned:
at start, and at most once every `keep_s / 24` while the server runs. Waiting is on an asyncio.Event per future (set from the worker thread through
the event loop), never a sleep loop. An Event exists only while someone waits on its future: the
last waiter to leave removes it, so polls of finished futures leave nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from twinkle.serve.core.records import FutureRow
from twinkle.serve.core.store import Store

JSON = "application/json"
PROTO = "application/x-protobuf"


class FutureHub:
    def __init__(self, store: Store, keep_s: float = 24 * 3600):
        self.futures, self.keep_s = store.futures, keep_s
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> (its Event, how many polls wait on it); only futures someone is waiting on
        self._events: dict[str, tuple[asyncio.Event, int]] = {}
        self._lock = threading.Lock()
        # Futures still pending when the last server stopped can never complete: say so, don't hang clients.
        self.futures.fail_pending(
            JSON,
            json.dumps(
                {
                    "error": "the server restarted while this request was pending, so it may or may not have run; "
                    "check its effect (e.g. list checkpoints) and resubmit it",
                    "category": "server",
                }
            ).encode(),
        )
        self._pruned_at = 0.0
        self.prune()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def prune(self) -> int:
        """Remove futures finished more than keep_s ago; -> how many."""
        self._pruned_at = now = time.time()
        return self.futures.prune(now - self.keep_s)

    def create(self, tenant: str) -> str:
        request_id = uuid.uuid4().hex
        self.futures.create(request_id, tenant)
        if time.time() - self._pruned_at > self.keep_s / 24:
            self.prune()
        return request_id

    def _finish(self, request_id: str, status: str, content_type: str, payload: bytes) -> None:
        self.futures.finish(request_id, status, content_type, payload)
        with self._lock:
            entry = self._events.get(request_id)
        if entry is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(entry[0].set)

    def complete_json(self, request_id: str, result: dict) -> None:
        self._finish(request_id, "complete", JSON, json.dumps(result).encode())

    def complete_proto(self, request_id: str, payload: bytes) -> None:
        self._finish(request_id, "complete", PROTO, payload)

    def fail(self, request_id: str, message: str, category: str) -> None:
        self._finish(request_id, "failed", JSON, json.dumps({"error": message, "category": category}).encode())

    async def wait(self, request_id: str, tenant: str, timeout: float) -> FutureRow | None:
        """The finished future, or the pending one after `timeout` s; None if unknown to this tenant."""
        # Registered before the row is read: a finish between the read and the wait still sets it.
        with self._lock:
            event, waiters = self._events.get(request_id) or (asyncio.Event(), 0)
            self._events[request_id] = (event, waiters + 1)
        try:
            row = self.futures.get(request_id, tenant)
            if row is None or row.status != "pending":
                return row
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except asyncio.TimeoutError:
                pass
            return self.futures.get(request_id, tenant)
        finally:
            with self._lock:
                event, waiters = self._events[request_id]
                if waiters > 1:
                    self._events[request_id] = (event, waiters - 1)
                else:
                    del self._events[request_id]

    def waiting(self) -> int:
        """Futures someone is polling now (the size of the only in-memory map this hub keeps)."""
        with self._lock:
            return len(self._events)
