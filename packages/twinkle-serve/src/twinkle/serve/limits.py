"""Per-tenant rate limits: token buckets for requests/s and input tokens/s, caps on models and request size.

A refusal carries how long to wait, which the routes return as `429` with `Retry-After`. Work over
the input-token rate is not refused but queued: it takes its tokens ahead of time and is held until
its turn (a `Hold`, which the scheduler honours and `retrieve_future` reports as `paused_rate_limit`
with the wait and the limit), unless that turn is more than `max_queue_wait_s` away.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from twinkle.serve.config import Limits


class LimitExceeded(Exception):
    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


@dataclass(frozen=True)
class Hold:
    """Queued work that may not start before `until` (time.monotonic()): the tenant's rate says so."""

    until: float
    limit: str  # the limit holding it, as the client is told: "tenant 'x''s limit of 20 input tokens/s"


class _Bucket:
    def __init__(self, rate: float, capacity: float | None = None):
        self.rate, self.capacity = rate, capacity or max(rate, 1.0)
        self.level, self.stamp = self.capacity, time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float) -> float:
        """0 if taken, else seconds until `amount` would be available."""
        self._refill()
        if amount > self.capacity:  # a request larger than a whole second's budget waits for a full bucket
            amount = self.capacity
        if self.level >= amount:
            self.level -= amount
            return 0.0
        return (amount - self.level) / self.rate

    def reserve(self, amount: float, max_wait: float) -> float:
        """Take `amount` now, into debt if need be: -> seconds until the debt is repaid (0: none), the
        time the work must wait. Past `max_wait` nothing is taken and the wait is returned negated."""
        self._refill()
        amount = min(amount, self.capacity)
        wait = max(0.0, (amount - self.level) / self.rate)
        if wait > max_wait:
            return -wait
        self.level -= amount  # below zero: later work waits behind this one (first come, first served)
        return wait


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
        with self._lock:
            wait = self._bucket(tenant, kind, rate, capacity).take(amount)
        if wait > 0:
            limit = f"{capacity:g}" if capacity else f"{rate:g}"
            raise LimitExceeded(f"tenant {tenant!r} is over its limit of {limit} {what}", wait)

    def _bucket(self, tenant: str, kind: str, rate: float, capacity: float | None = None) -> _Bucket:
        """The (key, kind) bucket, made on first use (call with the lock held): bounded by the keys
        the operator made, never by requests."""
        bucket = self._buckets.get((tenant, kind))
        if bucket is None:
            bucket = self._buckets[(tenant, kind)] = _Bucket(rate, capacity)
        return bucket

    def buckets(self) -> int:
        with self._lock:
            return len(self._buckets)

    def of(self, tenant: str) -> Limits:
        return self.overrides.get(tenant, self.default)

    def request(self, tenant: str) -> None:
        self._take(tenant, "req", self.of(tenant).requests_per_s, 1, "requests/s")

    def input_tokens(self, tenant: str, n: int) -> Hold | None:
        """Admit work of `n` input tokens: None to run in turn, a Hold to start later, LimitExceeded
        if it exceeds the per-request cap or its start would be more than max_queue_wait_s away."""
        limits = self.of(tenant)
        cap, rate = limits.max_input_tokens, limits.input_tokens_per_s
        if cap is not None and n > cap:
            raise LimitExceeded(
                f"request has {n} input tokens; tenant {tenant!r} may send at most {cap} per request", 60
            )
        if rate is None:
            return None
        with self._lock:
            wait = self._bucket(tenant, "tok", rate).reserve(n, limits.max_queue_wait_s)
        limit = f"tenant {tenant!r}'s limit of {rate:g} input tokens/s"
        if wait < 0:
            raise LimitExceeded(
                f"{limit} would hold this request {-wait:.0f} s, more than max_queue_wait_s "
                f"({limits.max_queue_wait_s:g} s): the queue is full",
                -wait - limits.max_queue_wait_s,
            )
        return Hold(time.monotonic() + wait, limit) if wait > 0 else None

    def models(self, tenant: str, live: int) -> None:
        cap = self.of(tenant).max_models
        if cap is not None and live >= cap:
            raise LimitExceeded(
                f"tenant {tenant!r} already has {live} models (limit {cap}); finish a session to free them", 30
            )

    def created(self, tenant: str, kind: str) -> None:
        """One more session, adapter, sampler or checkpoint for this key: 429 past `{kind}_per_minute`."""
        per_minute = getattr(self.of(tenant), f"{kind}_per_minute")
        if per_minute is not None:
            self._take(tenant, kind, per_minute / 60, 1, f"{kind} created per minute", capacity=per_minute)
