"""Retried submissions run once: `X-Idempotency-Key` (the Tinker SDK sends one per call, reused on retries).

The first request with a given (tenant, key) runs; its 2xx answer is stored in SQLite and every later
request with that key gets the stored answer (status, content type, body) without reaching a route.
A retry that arrives while the first is still being handled waits for it. Only 2xx answers are
stored: a refused request (4xx, 429) accepted nothing, so running its retry again is what the client
wants. The same key on a different request (method, path or body) is a client bug: 409.

Crashes: the answer is journaled when the route returns and committed with the next write (normally
the pass that runs the queued work, which commits its future in the same transaction; store/db.py).
A server killed before that commit loses the queued work with its memory (the future is reported
failed on restart), so the client's retry, which then runs afresh, does not run anything twice; only
a side effect already on disk in that window (a checkpoint written) could be written again. Answers are kept
`caps.idempotency_keep_hours` (24 h), and at most `caps.idempotency_max_rows` of them (the oldest go
first): expired and surplus rows are dropped at start and every tenth of the cap's writes or 1/24 of
the keep time, so the table never grows with the request count.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from twinkle.serve.auth import TENANT
from twinkle.serve.core.bounds import ServerCaps
from twinkle.serve.core.store import Store
from twinkle.serve.errors import send_asgi, send_asgi_error
from twinkle.serve.keys import KeyStore

HEADER = b"x-idempotency-key"
MAX_KEY_LEN = 200
# Reads and liveness calls (POST only because the SDK says so) are answered afresh every time.
NOT_REPLAYED = ("/retrieve_future", "/session_heartbeat", "/telemetry", "/client/config", "/client/dynamic_config")


class Idempotency:
    """Pure ASGI middleware (it must see the raw body to fingerprint it)."""

    def __init__(self, app, store: Store, keys: KeyStore, caps: ServerCaps | None = None, metrics=None):
        self.app, self.answers, self.keys = app, store.idempotency, keys
        caps = caps or ServerCaps()
        self.keep_s, self.max_rows = caps.idempotency_keep_hours * 3600, caps.idempotency_max_rows
        # only requests being handled now: each entry is removed when its request finishes
        self._in_flight: dict[tuple[str, str], asyncio.Event] = {}
        if metrics is not None:
            metrics.retain("idempotency in flight", lambda: len(self._in_flight))
        self._writes = 0
        self.housekeep()

    def housekeep(self) -> None:
        """Drop answers past the keep time, then all but the newest max_rows."""
        self._swept_at = time.time()
        self.answers.purge(self._swept_at - self.keep_s)
        self.answers.trim(self.max_rows)

    def _stored(self) -> None:
        self._writes += 1
        if self._writes % max(self.max_rows // 10, 1) == 0 or time.time() - self._swept_at > self.keep_s / 24:
            self.housekeep()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "GET" or scope["path"].endswith(NOT_REPLAYED):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = headers.get(HEADER, b"").decode("latin-1")
        tenant = self.keys.tenant_for(headers.get(b"x-api-key", b"").decode("latin-1") or None)
        if tenant is not None:
            scope[TENANT] = tenant  # the auth dependency reads it: one key lookup per request
        if not key or tenant is None:  # no key: nothing to dedupe; no tenant: auth answers 401 downstream
            return await self.app(scope, receive, send)
        if len(key) > MAX_KEY_LEN:
            return await send_asgi_error(send, 400, f"X-Idempotency-Key is longer than {MAX_KEY_LEN} characters")

        body, disconnected = await _read_body(receive)
        fingerprint = hashlib.sha256(b"%s %s\n" % (scope["method"].encode(), scope["path"].encode()) + body).hexdigest()
        slot = (tenant, key)
        while (event := self._in_flight.get(slot)) is not None:  # a retry racing the original
            await event.wait()
        stored = self.answers.get(*slot)
        if stored is not None:
            if stored["fingerprint"] != fingerprint:
                return await send_asgi_error(
                    send,
                    409,
                    f"X-Idempotency-Key {key!r} was already used for a different request; use a new key per request",
                )
            return await send_asgi(
                send,
                stored["status"],
                stored["body"],
                stored["content_type"].encode("latin-1"),
                headers=[(b"idempotent-replayed", b"true")],
            )

        self._in_flight[slot] = event = asyncio.Event()
        answer: dict[str, Any] = {"status": 0, "content_type": b"", "body": []}

        unread = [body]

        async def replay_receive():
            if unread:
                return {"type": "http.request", "body": unread.pop(), "more_body": False}
            return await receive() if not disconnected else {"type": "http.disconnect"}

        async def capture_send(message):
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["content_type"] = dict(message.get("headers", [])).get(b"content-type", b"")
            elif message["type"] == "http.response.body":
                answer["body"].append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, replay_receive, capture_send)
            if 200 <= answer["status"] < 300:
                self.answers.put(
                    tenant,
                    key,
                    fingerprint,
                    answer["status"],
                    answer["content_type"].decode("latin-1"),
                    b"".join(answer["body"]),
                )
                self._stored()
        finally:
            self._in_flight.pop(slot, None)
            event.set()


async def _read_body(receive) -> tuple[bytes, bool]:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"".join(chunks), True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False
