"""The server's durable state: one SQLite file in the data dir.

Sessions, training models (= Tinker training runs), samplers, checkpoint metadata, futures, API
keys and the answers to idempotent submissions. Checkpoint *files* live beside it under `tenants/<tenant>/...`; this file says which exist.
Everything a client was told (a future's result, a checkpoint path) is committed here before the
client can see it, so a restart on the same data dir loses nothing that was acknowledged.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (name TEXT PRIMARY KEY, key_hash TEXT UNIQUE NOT NULL,
    created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, created_at REAL,
    last_heartbeat REAL, finished_at REAL, finish_reason TEXT, tags TEXT, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS models (model_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT,
    base_model TEXT, lora TEXT, created_at REAL, last_request_time REAL, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS samplers (sampler_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT,
    base_model TEXT, model_path TEXT, created_at REAL, ephemeral INTEGER DEFAULT 0);
CREATE TABLE IF NOT EXISTS checkpoints (tinker_path TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_id TEXT,
    kind TEXT, name TEXT, created_at REAL, size_bytes INTEGER, public INTEGER DEFAULT 0, expires_at REAL,
    dir TEXT, user_metadata TEXT);
CREATE TABLE IF NOT EXISTS futures (request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT,
    content_type TEXT, payload BLOB, created_at REAL, completed_at REAL);
CREATE TABLE IF NOT EXISTS idempotency (tenant TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,
    status INTEGER, content_type TEXT, body BLOB, created_at REAL, PRIMARY KEY (tenant, key));
"""

# ---- tables of the SDK 0.38 routes in tinker/routes_extra.py (custom losses, sampling completions, usage) ----
SCHEMA += """
CREATE TABLE IF NOT EXISTS custom_losses (loss_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, session_id TEXT,
    name TEXT, inputs TEXT, graph TEXT, created_at REAL);
CREATE TABLE IF NOT EXISTS sample_requests (request_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, sampler_id TEXT,
    clone INTEGER, completion INTEGER);
CREATE TABLE IF NOT EXISTS sampler_clients (sampler_id TEXT PRIMARY KEY, clients INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS session_projects (session_id TEXT PRIMARY KEY, project_id TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS usage (tenant TEXT NOT NULL, hour INTEGER NOT NULL, session_id TEXT NOT NULL,
    base_model TEXT NOT NULL, kind TEXT NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (tenant, hour, session_id, base_model, kind));
"""


class Store:
    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / "twinkle.db", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA busy_timeout=5000")
            self._db.executescript(SCHEMA)

    def close(self):
        with self._lock:
            self._db.close()

    def execute(self, sql: str, args=()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def one(self, sql: str, args=()) -> dict | None:
        with self._lock:
            row = self._db.execute(sql, args).fetchone()
        return dict(row) if row else None

    def all(self, sql: str, args=()) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._db.execute(sql, args).fetchall()]

    # ---- generic helpers used by the service ----
    def insert(self, table: str, **values) -> None:
        values = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in values.items()}
        cols = ", ".join(values)
        marks = ", ".join("?" for _ in values)
        self.execute(f"INSERT OR REPLACE INTO {table} ({cols}) VALUES ({marks})", tuple(values.values()))

    def owned(self, table: str, key: str, value: str, tenant: str) -> dict | None:
        """The row if it exists *and* belongs to `tenant`; otherwise None (callers answer 404 either way)."""
        if not isinstance(value, str):  # an id of another JSON type names nothing (and SQLite can't bind a dict)
            return None
        return self.one(f"SELECT * FROM {table} WHERE {key} = ? AND tenant = ?", (value, tenant))

    def touch_model(self, model_id: str) -> None:
        self.execute("UPDATE models SET last_request_time = ? WHERE model_id = ?", (time.time(), model_id))

    # ---- the SDK 0.38 routes of tinker/routes_extra.py ----
    def record_sample_request(self, request_id: str, tenant: str, sampler_id: str, clone: int) -> None:
        self.insert("sample_requests", request_id=request_id, tenant=tenant, sampler_id=sampler_id, clone=clone)

    def sample_request(self, request_id: str, tenant: str) -> dict | None:
        return self.owned("sample_requests", "request_id", request_id, tenant)

    def sample_completions(self, tenant: str, sampler_id: str, clone: int, after: int) -> tuple[list, list]:
        """-> (finished requests numbered after `after`, in completion order, with status and payload size;
        request ids still pending). A request is numbered once, the first time it is seen finished."""
        rows = self.all("SELECT s.request_id, s.completion, f.status, LENGTH(f.payload) AS size FROM sample_requests s "
                        "JOIN futures f ON f.request_id = s.request_id WHERE s.tenant=? AND s.sampler_id=? "
                        "AND s.clone=? AND (s.completion IS NULL OR s.completion > ?) ORDER BY f.completed_at",
                        (tenant, sampler_id, clone, after))
        for row in rows:
            if row["completion"] is None and row["status"] != "pending":
                self.execute("UPDATE sample_requests SET completion = (SELECT COALESCE(MAX(completion), 0) + 1 "
                             "FROM sample_requests) WHERE request_id=? AND completion IS NULL", (row["request_id"],))
                row["completion"] = self.one("SELECT completion FROM sample_requests WHERE request_id=?",
                                             (row["request_id"],))["completion"]
        done = sorted((r for r in rows if r["status"] != "pending"), key=lambda r: r["completion"])
        return done, [r["request_id"] for r in rows if r["status"] == "pending"]

    def forget_sample_requests(self, tenant: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.execute("DELETE FROM sample_requests WHERE request_id=? AND tenant=?", (request_id, tenant))

    def join_sampler(self, sampler_id: str) -> int:
        """The next client number of a sampling session (its original client is 0)."""
        with self._lock:
            self._db.execute("INSERT INTO sampler_clients (sampler_id, clients) VALUES (?, 1) ON CONFLICT(sampler_id) "
                             "DO UPDATE SET clients = clients + 1", (sampler_id,))
            return self._db.execute("SELECT clients FROM sampler_clients WHERE sampler_id=?",
                                    (sampler_id,)).fetchone()[0]
