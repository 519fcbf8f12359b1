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

    def add_usage(self, tenant: str, session_id: str | None, base_model: str, kind: str, tokens: int) -> None:
        """Count `tokens` of `kind` (training, sampling_prefill, sampling_sample) in this UTC hour's bucket."""
        hour = int(time.time()) // 3600 * 3600
        self.execute("INSERT INTO usage (tenant, hour, session_id, base_model, kind, tokens) VALUES (?, ?, ?, ?, ?, ?) "
                     "ON CONFLICT(tenant, hour, session_id, base_model, kind) DO UPDATE SET tokens = tokens + ?",
                     (tenant, hour, session_id or "", base_model, kind, int(tokens), int(tokens)))

    def usage_buckets(self, tenant: str, start: float, end: float) -> list[dict]:
        return self.all("SELECT hour, session_id, base_model, kind, tokens FROM usage WHERE tenant=? AND hour >= ? "
                        "AND hour < ? ORDER BY hour, tokens DESC", (tenant, start, end))

    def checkpoint_storage(self, tenant: str, project_id: str | None) -> dict:
        """Live checkpoints of `tenant` (of one project's sessions, if given): count and bytes."""
        sql = ("SELECT COUNT(*) AS n, COALESCE(SUM(c.size_bytes), 0) AS size FROM checkpoints c "
               "LEFT JOIN models m ON m.model_id = c.model_id LEFT JOIN session_projects p ON p.session_id = m.session_id "
               "WHERE c.tenant=? AND (c.expires_at IS NULL OR c.expires_at > ?)")
        args = [tenant, time.time()]
        if project_id is not None:
            sql += " AND COALESCE(p.project_id, 'default') = ?"
            args.append(project_id)
        return self.one(sql, tuple(args))

    def set_session_project(self, session_id: str, project_id: str) -> None:
        self.insert("session_projects", session_id=session_id, project_id=project_id)

    def sessions_with_details(self, tenant: str) -> list[dict]:
        """Every session of `tenant`, newest first, with its project and checkpoint count and bytes."""
        return self.all("SELECT s.*, COALESCE(p.project_id, 'default') AS project_id, "
                        "(SELECT COUNT(*) FROM checkpoints c JOIN models m ON m.model_id = c.model_id "
                        " WHERE m.session_id = s.session_id) AS checkpoints_count, "
                        "(SELECT COALESCE(SUM(c.size_bytes), 0) FROM checkpoints c JOIN models m "
                        " ON m.model_id = c.model_id WHERE m.session_id = s.session_id) AS checkpoint_bytes "
                        "FROM sessions s LEFT JOIN session_projects p ON p.session_id = s.session_id "
                        "WHERE s.tenant=? ORDER BY s.created_at DESC, s.session_id DESC", (tenant,))

    def session_project(self, session_id: str) -> str:
        row = self.one("SELECT project_id FROM session_projects WHERE session_id=?", (session_id,))
        return row["project_id"] if row else "default"

    def session_metadata(self, session_id: str) -> dict | None:
        row = self.one("SELECT user_metadata FROM sessions WHERE session_id=?", (session_id,))
        meta = json.loads(row["user_metadata"]) if row and row["user_metadata"] else None
        return {str(k): str(v) for k, v in meta.items()} if meta else None

    def api_key_row(self, name: str) -> dict | None:
        return self.one("SELECT rowid AS key_id, name, created_at FROM api_keys WHERE name=? AND revoked_at IS NULL",
                        (name,))

    def session_timeline(self, session_id: str) -> dict:
        """What the store knows happened in a session: its runs, samplers and checkpoints (for a trace)."""
        return {"models": self.all("SELECT model_id, base_model, created_at FROM models WHERE session_id=?",
                                   (session_id,)),
                "samplers": self.all("SELECT sampler_id, model_path, created_at FROM samplers WHERE session_id=?",
                                     (session_id,)),
                "checkpoints": self.all("SELECT c.tinker_path, c.kind, c.created_at, c.size_bytes FROM checkpoints c "
                                        "JOIN models m ON m.model_id = c.model_id WHERE m.session_id=?", (session_id,)),
                "usage": self.all("SELECT hour, kind, tokens FROM usage WHERE session_id=? ORDER BY hour",
                                  (session_id,))}
