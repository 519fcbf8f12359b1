"""Futures: every proxy call returns one at once; `.result()` (or `await`) waits for the server.

Reading a Future's value as a mapping or a number (`out["loss"]`, `out.get(...)`, `"loss" in out`,
iterating, `float(out)`, `dict(out)`) waits for the result first, so a loop written for local objects
runs unchanged while calls whose result is never looked at stay pipelined. Nothing Python calls on its
own waits: `==` is identity, `str()` / `repr()` show the value when it is known and "pending" otherwise,
and a Future is always true (no `__len__`), so logging one or testing `if out:` never blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from twinkle.client.errors import TwinkleRequestFailed
from twinkle.client.schema import FutureRef, FutureResult

_UNSET = object()
POLL_S = 25.0
log = logging.getLogger("twinkle.client")


class Future:
    def __init__(self, client, ref: FutureRef | dict, parse: Callable[[Any], Any] | None = None):
        ref = ref if isinstance(ref, FutureRef) else FutureRef.model_validate(ref)
        self.client, self.request_id, self.model_id = client, ref.request_id, ref.model_id
        self._parse = parse or (lambda x: x)
        self._value = _UNSET
        # while pending: where the server says it waits (FutureResult.queue_state / queue_reason)
        self.queue_state: str | None = None
        self.queue_reason: str | None = None

    def _settle(self, answer: dict) -> bool:
        res = FutureResult.model_validate(answer)
        if res.status == "pending":
            if res.queue_state == "paused_rate_limit" and self.queue_state != res.queue_state:
                log.warning("request %s is queued, not refused: %s", self.request_id, res.queue_reason)
            self.queue_state, self.queue_reason = res.queue_state, res.queue_reason
            return False
        if res.status == "failed":
            raise TwinkleRequestFailed(
                f"request {self.request_id} failed ({res.category}): {res.error}", category=res.category
            )
        self._value = self._parse(res.result)
        return True

    def done(self) -> bool:
        return self._value is not _UNSET or self._settle(self.client.get(f"/futures/{self.request_id}", timeout=0))

    def result(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._value is _UNSET:
            wait = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
            if (
                not self._settle(self.client.get(f"/futures/{self.request_id}", timeout=wait))
                and deadline is not None
                and time.monotonic() >= deadline
            ):
                raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
        return self._value

    def cancel(self) -> str:
        """Ask the server to stop this request: 'cancelled' (it had not started, or it runs in slices,
        a decode or a long pass, and stops at its next step; `result()` then raises saying so),
        'running' (it runs whole and finishes) or 'finished'."""
        return self.client.post(f"/futures/{self.request_id}/cancel")["status"]

    async def aresult(self):
        while self._value is _UNSET:
            self._settle(await self.client.arequest("GET", f"/futures/{self.request_id}", params={"timeout": POLL_S}))
        return self._value

    def __await__(self):
        return self.aresult().__await__()

    # ---- standing in for the value -------------------------------------------------------------
    def __getitem__(self, key):
        return self.result()[key]

    def get(self, key, default=None):
        return self.result().get(key, default)

    def keys(self):
        return self.result().keys()

    def items(self):
        return self.result().items()

    def values(self):
        return self.result().values()

    def __iter__(self):
        return iter(self.result())

    def __contains__(self, item):
        return item in self.result()

    def __float__(self):
        return float(self.result())

    def __repr__(self):
        state = repr(self._value) if self._value is not _UNSET else "pending"
        return f"<Future {self.request_id[:8]} {state}>"
