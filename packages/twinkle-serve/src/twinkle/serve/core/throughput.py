"""The token throughput window the status route reports (tokens per second over the last minute)."""

from __future__ import annotations

import collections
import threading
import time

WINDOW_S = 60.0


class Throughput:
    def __init__(self):
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def count_tokens(self, n: int) -> None:
        with self._lock:
            self._tokens.append((time.monotonic(), n))

    def tokens_per_s(self) -> float:
        cutoff = time.monotonic() - WINDOW_S
        with self._lock:
            while self._tokens and self._tokens[0][0] < cutoff:
                self._tokens.popleft()
            return sum(n for _, n in self._tokens) / WINDOW_S
