"""The store's one SQLite connection, and its journal: writes that may wait for the next commit.

A steady training step used to cost one transaction per bookkeeping row (a future created and
finished, the idempotency answer, a curve point, usage, the run's last request time). Those rows
are journaled instead (`soon`) and committed together: by the next write of any kind (it takes the
journal along in its transaction), by `flush` (the scheduler calls it once per pass, before it wakes
anyone waiting on that pass's results), at `close`, and by a flusher thread once a row has waited
`flush_after_s` while no queued request is outstanding (one is: its pass will commit the journal, so
a long pass costs no extra write), or `max_wait_s` in any case. A result is therefore on disk before any client can
read it; what a kill -9 can lose is only rows no client has depended on yet (an accepted request's
pending future, which the restarted server then reports as lost with the restart error).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from twinkle.serve.core.store.schema import migrate

log = logging.getLogger("twinkle.serve")

Statement = tuple[str, tuple]


class Db:
    """One connection shared by threads, serialised by a lock; rows come back as dicts."""

    def __init__(self, path: Path, flush_after_s: float = 0.5, max_wait_s: float = 30.0):
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self.writes = 0  # write transactions committed: what a step costs the store (tests read it)
        # statements waiting for the next commit, and what to run once they are on disk
        self._journal: list[Statement] = []
        self._done: list[Callable[[], None]] = []
        self._oldest = 0.0  # when the journal's first row was queued
        self.flush_after_s, self.max_wait_s = flush_after_s, max_wait_s
        self.outstanding = 0  # futures created and not yet finished (Futures keeps it): a pass will commit
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            # With WAL, NORMAL syncs at checkpoints, not on every commit: a killed server process
            # loses nothing it committed (the WAL is in the OS's cache); only a power cut could.
            # FULL cost an fsync per request row, several per training step.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA busy_timeout=5000")
            self.version = migrate(self._conn)
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_stale, name="twinkle-store-flush", daemon=True)
        self._flusher.start()

    # ---- the journal ---------------------------------------------------------------------------
    def soon(self, statements: list[Statement], done: Callable[[], None] | None = None) -> None:
        """Queue statements for the next commit (all of them in it, in order); `done()` runs once
        they are committed (the tables drop their in-memory view of the rows then)."""
        with self._lock:
            if not self._journal:
                self._oldest = time.monotonic()
            self._journal.extend(statements)
            if done is not None:
                self._done.append(done)

    def flush(self) -> None:
        """Commit the journal now (one write), if it holds anything."""
        with self._lock:
            if not self._journal:
                return
            done = self._commit([])
        _run(done)

    def pending_writes(self) -> int:
        with self._lock:
            return len(self._journal)

    def _flush_stale(self) -> None:
        while not self._closed.wait(self.flush_after_s / 2):
            with self._lock:
                age = time.monotonic() - self._oldest if self._journal else 0.0
                stale = age >= (self.flush_after_s if self.outstanding <= 0 else self.max_wait_s)
            if stale:
                try:
                    self.flush()
                except sqlite3.Error:  # kept in the journal; the next commit tries again
                    log.exception("the store could not commit its journal")

    def _commit(self, statements: list[Statement]) -> list[Callable[[], None]]:
        """Under the lock: the journal and `statements` in one transaction; -> the callbacks to run."""
        with self._begun() as conn:
            for sql, args in statements:
                conn.execute(sql, args)
        done, self._done = self._done, []
        return done

    @contextmanager
    def _begun(self):
        """Under the lock: BEGIN, the journal, the caller's statements, COMMIT. The journal is emptied
        only once the commit succeeded (a failed write keeps it for the next one)."""
        self.writes += 1
        self._conn.execute("BEGIN")
        try:
            for sql, args in self._journal:
                self._conn.execute(sql, args)
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")
        self._journal = []

    # ---- writes and reads ----------------------------------------------------------------------
    def execute(self, sql: str, args=()) -> int:
        if sql.lstrip().upper().startswith("SELECT"):
            with self._lock:
                return self._conn.execute(sql, args).rowcount
        with self._transaction() as conn:
            return conn.execute(sql, args).rowcount

    def execute_many(self, sql: str, rows: list[tuple]) -> None:
        """Several rows in one transaction: one write (one WAL commit), not one per row."""
        if rows:
            with self._transaction() as conn:
                conn.executemany(sql, rows)

    def execute_all(self, statements: list[Statement]) -> None:
        """Several statements in one transaction: one write, all or nothing."""
        if statements:
            with self._transaction() as conn:
                for sql, args in statements:
                    conn.execute(sql, args)

    @contextmanager
    def _transaction(self):
        """One write transaction; the journal goes first in it (so it costs no commit of its own)."""
        with self._lock:
            with self._begun() as conn:
                yield conn
            done, self._done = self._done, []
        _run(done)

    def one(self, sql: str, args=()) -> dict | None:
        with self._lock:
            row = self._conn.execute(sql, args).fetchone()
        return dict(row) if row else None

    def all(self, sql: str, args=()) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql, args).fetchall()]

    def close(self) -> None:
        self._closed.set()
        self._flusher.join(timeout=5)
        self.flush()  # nothing journaled is lost at a clean shutdown
        with self._lock:
            self._conn.close()


def _run(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        callback()
