"""Per-tenant rate limits: token buckets for requests/s and input tokens/s, caps on models and request size.

A refusal carries how long to wait, which the routes return as `429` with `Retry-After`.
"""

from __future__ import annotations

import math
import threading
import time

from twinkle.serve.config import Limits


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class _Bucket:
    def __init__(self, rate: float, capacity: float | None = None):
        self.rate, self.capacity = rate, capacity or max(rate, 1.0)
        self.level, self.stamp = self.capacity, time.monotonic()

    def take(self, amount: float) -> float:
        """0 if taken, else seconds until `amount` would be available."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount > self.capacity:  # a request larger than a whole second's budget waits for a full bucket
            amount = self.capacity
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate


class TenantLimits:
    def __init__(self, limits: Limits, overrides: dict[str, Limits] | None = None):
        self.default, self.overrides = limits, overrides or {}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._lock = threading.Lock()

    def _take(
        self, tenant: str, kind: str, rate: float | None, amount: float, what: str, capacity: float | None = None
    ) -> None:
        if rate is None:
            return
        # one bucket per (key, kind): bounded by the keys the operator made, never by requests
        with self._lock:
            bucket = self._buckets.get((tenant, kind))
            if bucket is None:
                bucket = self._buckets[(tenant, kind)] = _Bucket(rate, capacity)
            wait = bucket.take(amount)
        if wait > 0:
            limit = f"{capacity:g}" if capacity else f"{rate:g}"
            raise LimitExceeded(f"tenant {tenant!r} is over its limit of {limit} {what}", wait)

    def buckets(self) -> int:
        with self._lock:
            return len(self._buckets)

    def of(self, tenant: str) -> Limits:
        return self.overrides.get(tenant, self.default)

    def request(self, tenant: str) -> None:
        self._take(tenant, "req", self.of(tenant).requests_per_s, 1, "requests/s")

    def input_tokens(self, tenant: str, n: int) -> None:
        cap = self.of(tenant).max_input_tokens
        if cap is not None and n > cap:
            raise LimitExceeded(
                f"request has {n} input tokens; tenant {tenant!r} may send at most {cap} per request", 60
            )
        self._take(tenant, "tok", self.of(tenant).input_tokens_per_s, n, "input tokens/s")

    def models(self, tenant: str, live: int) -> None:
        cap = self.of(tenant).max_models
        if cap is not None and live >= cap:
            raise LimitExceeded(
                f"tenant {tenant!r} already has {live} models (limit {cap}); finish a session to free them", 30
            )

    def created(self, tenant: str, kind: str) -> None:
        """One more session or adapter for this key: 429 past `{kind}_per_minute`."""
        per_minute = getattr(self.of(tenant), f"{kind}_per_minute")
        if per_minute is not None:
            self._take(tenant, kind, per_minute / 60, 1, f"{kind} created per minute", capacity=per_minute)
