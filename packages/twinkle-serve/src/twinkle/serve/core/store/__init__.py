"""The server's durable state: one SQLite file in the data dir, and every SQL statement the server runs.

Sessions, training runs, samplers, checkpoint metadata, futures, API keys, the answers to idempotent
submissions, the runs' curves, token usage, per-key quotas and the samples a run shows on the dashboard. Checkpoint *files* live beside it under `tenants/<tenant>/...`;
this file says which exist. Everything a client was told (a future's result, a checkpoint path) is
committed here before the client can see it, so a restart on the same data dir loses nothing that
was acknowledged. The schema is versioned (`schema.py`); opening an older database upgrades it.
"""

from __future__ import annotations

import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path

from twinkle.serve.core.store.account_tables import (
    CustomLosses,
    Projects,
    Quotas,
    RunSamples,
    SampleRequests,
    Usage,
)
from twinkle.serve.core.store.objects import Checkpoints, Runs, Samplers, Sessions
from twinkle.serve.core.store.schema import VERSION, migrate
from twinkle.serve.core.store.service_tables import Curves, Futures, Idempotency, Keys
from twinkle.serve.core.store.stability_tables import StabilityRecords

__all__ = ["Store", "VERSION"]


class Db:
    """One connection shared by threads, serialised by a lock; rows come back as dicts."""

    def __init__(self, path: Path):
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self.writes = 0  # write transactions committed: what a step costs the store (tests read it)
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # With WAL, NORMAL syncs at checkpoints, not on every commit: a killed server process
            # loses nothing it committed (the WAL is in the OS's cache); only a power cut could.
            # FULL cost an fsync per request row, several per training step.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA busy_timeout=5000")
            self.version = migrate(self._conn)

    def execute(self, sql: str, args=()) -> int:
        with self._lock:
            self.writes += not sql.lstrip().upper().startswith("SELECT")
            return self._conn.execute(sql, args).rowcount

    def execute_many(self, sql: str, rows: list[tuple]) -> None:
        """Several rows in one transaction: one write (one WAL commit), not one per row."""
        if rows:
            with self._transaction() as conn:
                conn.executemany(sql, rows)

    def execute_all(self, statements: list[tuple[str, tuple]]) -> None:
        """Several statements in one transaction: one write, all or nothing."""
        if statements:
            with self._transaction() as conn:
                for sql, args in statements:
                    conn.execute(sql, args)

    @contextmanager
    def _transaction(self):
        with self._lock:
            self.writes += 1
            self._conn.execute("BEGIN")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def one(self, sql: str, args=()) -> dict | None:
        with self._lock:
            row = self._conn.execute(sql, args).fetchone()
        return dict(row) if row else None

    def all(self, sql: str, args=()) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql, args).fetchall()]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class Store:
    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = Db(self.data_dir / "twinkle.db")
        self.keys, self.sessions, self.runs = Keys(self.db), Sessions(self.db), Runs(self.db)
        self.samplers, self.checkpoints = Samplers(self.db), Checkpoints(self.db)
        self.futures, self.idempotency, self.curves = Futures(self.db), Idempotency(self.db), Curves(self.db)
        self.custom_losses, self.sample_requests = CustomLosses(self.db), SampleRequests(self.db)
        self.projects, self.usage, self.quotas = Projects(self.db), Usage(self.db), Quotas(self.db)
        self.run_samples = RunSamples(self.db)
        self.stability = StabilityRecords(self.db)  # stable_reinforce's sampled-sequence records

    @property
    def version(self) -> int:
        return self.db.version

    def close(self) -> None:
        self.db.close()
