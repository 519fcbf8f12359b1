"""Futures: every submission gets a request id; `retrieve_future` long-polls it.

Results are written to SQLite before the waiting poll is woken, so a result a client has seen
survives a restart. Rows are journaled (`store/db.py`): a scheduler pass runs inside `batch()`, whose
end commits every row of the pass at once and only then wakes the polls. A future's id starts with
this boot's id, so one whose pending row a kill -9 lost is answered, after the restart, with the same
restart error as one whose row survived. Finished futures are kept `keep_s` (the config's futures_keep_hours), then pruned:
at start, and at most once every `keep_s / 24` while the server runs. Waiting is on an asyncio.Event per future (set from the worker thread through
the event loop), never a sleep loop. An Event exists only while someone waits on its future: the
last waiter to leave removes it, so polls of finished futures leave nothing behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sqlite3
import threading
import time
from contextlib import contextmanager, suppress

from twinkle.serve.core.records import FutureRow
from twinkle.serve.core.store import Store
from twinkle.serve.core.work import JSON, StoredAnswer

log = logging.getLogger("twinkle.serve")
BOOT_HEX, TIME_HEX = 8, 8  # a request id: boot id, creation second, random (32 hex digits, as a uuid's)
RESTARTED = json.dumps(
    {
        "error": "the server restarted while this request was pending, so it may or may not have run; "
        "check its effect (e.g. list checkpoints) and resubmit it",
        "category": "server",
    }
).encode()


class FutureHub:
    def __init__(self, store: Store, keep_s: float = 24 * 3600):
        self.futures, self.keep_s = store.futures, keep_s
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> (its Event, how many polls wait on it); only futures someone is waiting on
        self._events: dict[str, tuple[asyncio.Event, int]] = {}
        self._lock = threading.Lock()
        self._batch = threading.local()  # this thread's pass: the events to set once its rows are committed
        # Futures still pending when the last server stopped can never complete: say so, don't hang clients.
        self.futures.fail_pending(JSON, RESTARTED)
        self.boot_id = secrets.token_hex(BOOT_HEX // 2)
        self.futures.start_boot(self.boot_id)
        self._pruned_at = 0.0
        self.prune()

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def prune(self) -> int:
        """Remove futures finished more than keep_s ago; -> how many."""
        self._pruned_at = now = time.time()
        return self.futures.prune(now - self.keep_s)

    def create(self, tenant: str) -> str:
        request_id = f"{self.boot_id}{int(time.time()):0{TIME_HEX}x}{secrets.token_hex(8)}"
        self.futures.create(request_id, tenant)
        if time.time() - self._pruned_at > self.keep_s / 24:
            self.prune()
        return request_id

    @contextmanager
    def batch(self):
        """Futures finished inside are committed together at its end (one write), then woken."""
        self._batch.finished = finished = []
        try:
            yield
        finally:
            self._batch.finished = None
            try:
                self.futures.db.flush()
            except sqlite3.Error:  # the rows stay journaled for the next commit; the worker serves on
                log.exception("the store could not commit a pass's results")
            self._wake(finished)

    def _finish(self, request_id: str, status: str, content_type: str, payload: bytes) -> None:
        self.futures.finish(request_id, status, content_type, payload)
        finished = getattr(self._batch, "finished", None)
        if finished is not None:
            finished.append(request_id)
            return
        try:
            self.futures.db.flush()
        finally:
            self._wake([request_id])

    def _wake(self, request_ids: list[str]) -> None:
        with self._lock:
            events = [entry[0] for r in request_ids if (entry := self._events.get(r)) is not None]
        if self._loop is not None:
            for event in events:
                self._loop.call_soon_threadsafe(event.set)

    def complete(self, request_id: str, answer: StoredAnswer) -> None:
        self._finish(request_id, "complete", answer.content_type, answer.body)

    def complete_json(self, request_id: str, result: dict) -> None:
        self.complete(request_id, StoredAnswer.json(result))

    def complete_proto(self, request_id: str, payload: bytes) -> None:
        self.complete(request_id, StoredAnswer.proto(payload))

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
                return row or self._lost(request_id)
            with suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
            return self.futures.get(request_id, tenant)
        finally:
            with self._lock:
                event, waiters = self._events[request_id]
                if waiters > 1:
                    self._events[request_id] = (event, waiters - 1)
                else:
                    del self._events[request_id]

    def _lost(self, request_id: str) -> FutureRow | None:
        """A future of an earlier boot, younger than keep_s, that has no row: a kill -9 lost its
        journaled row while it was pending. Anything else unknown is None (404)."""
        boot, created = request_id[:BOOT_HEX], request_id[BOOT_HEX : BOOT_HEX + TIME_HEX]
        try:
            young = time.time() - int(created, 16) < self.keep_s
        except ValueError:
            return None
        if len(request_id) != 32 or boot == self.boot_id or not young or not self.futures.was_boot(boot):
            return None
        return FutureRow(request_id, "failed", JSON, RESTARTED)

    def waiting(self) -> int:
        """Futures someone is polling now (the size of the only in-memory map this hub keeps)."""
        with self._lock:
            return len(self._events)
