"""Per-run curves (loss, grad norm, lr, client-logged rewards) in the server's SQLite store, and the
token throughput window the status route reports. The table is created beside the core schema."""

from __future__ import annotations

import collections
import threading
import time

from twinkle.serve.store import Store

SCHEMA = ("CREATE TABLE IF NOT EXISTS run_curves (model_id TEXT NOT NULL, tenant TEXT NOT NULL, step INTEGER, "
          "name TEXT NOT NULL, value REAL, t REAL)")
INDEX = "CREATE INDEX IF NOT EXISTS run_curves_model ON run_curves (model_id, name, step)"
WINDOW_S = 60.0


class Curves:
    def __init__(self, store: Store):
        self.store = store
        store.execute(SCHEMA)
        store.execute(INDEX)
        self._tokens: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()

    def add(self, model_id: str, tenant: str, step: int | None, metrics: dict[str, float]) -> None:
        now = time.time()
        for name, value in metrics.items():
            if value is None:
                continue
            self.store.insert("run_curves", model_id=model_id, tenant=tenant, step=step, name=name,
                              value=float(value), t=now)

    def of(self, model_id: str, since_step: int = -1) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for row in self.store.all("SELECT step, name, value, t FROM run_curves WHERE model_id=? AND step>? "
                                  "ORDER BY step, t", (model_id, since_step)):
            out.setdefault(row["name"], []).append({"step": row["step"], "value": row["value"], "t": row["t"]})
        return out

    def last(self, model_id: str, name: str) -> dict | None:
        return self.store.one("SELECT step, value FROM run_curves WHERE model_id=? AND name=? "
                              "ORDER BY step DESC, t DESC LIMIT 1", (model_id, name))

    def count_tokens(self, n: int) -> None:
        with self._lock:
            self._tokens.append((time.monotonic(), n))

    def tokens_per_s(self) -> float:
        cutoff = time.monotonic() - WINDOW_S
        with self._lock:
            while self._tokens and self._tokens[0][0] < cutoff:
                self._tokens.popleft()
            return sum(n for _, n in self._tokens) / WINDOW_S
