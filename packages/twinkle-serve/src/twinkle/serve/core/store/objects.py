"""SQL for the service's objects: sessions, training runs, samplers, checkpoints (typed records in and out).

Lookups that take a tenant answer None for another tenant's object: the routes then say 404, the
same answer as for an object that does not exist.
"""

from __future__ import annotations

import builtins  # the stores have a `list` method, which shadows the builtin in class scope
import json
import time
from dataclasses import asdict

from twinkle.serve.core.records import Checkpoint, Run, SamplingSession, Session
from twinkle.serve.errors import NotFound


def put_row(db, table: str, values: dict) -> None:
    values = {k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in values.items()}
    cols, marks = ", ".join(values), ", ".join("?" for _ in values)
    db.execute(f"INSERT OR REPLACE INTO {table} ({cols}) VALUES ({marks})", tuple(values.values()))


def _id(value) -> bool:
    return isinstance(value, str)  # an id of another JSON type names nothing (and SQLite can't bind a dict)


class Sessions:
    def __init__(self, db):
        self.db = db

    def create(self, session: Session) -> None:
        put_row(self.db, "sessions", asdict(session))

    def owned(self, session_id, tenant: str) -> Session | None:
        row = _id(session_id) and self.db.one(
            "SELECT * FROM sessions WHERE session_id=? AND tenant=?", (session_id, tenant)
        )
        return Session.from_row(row) if row else None

    def get(self, session_id: str) -> Session | None:
        row = self.db.one("SELECT * FROM sessions WHERE session_id=?", (session_id,))
        return Session.from_row(row) if row else None

    def heartbeat(self, session_id: str) -> None:
        # journaled: every SDK client heartbeats every 10 s, and a session is "active" for a minute after
        # one, so the row may ride along with the next pass's commit instead of costing a write of its own
        self.db.soon([("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id))])

    def live(self, tenant: str, since: float) -> int:
        """`tenant`'s sessions not finished and heard from (created or heartbeat) at or after `since`."""
        row = self.db.one(
            "SELECT COUNT(*) AS n FROM sessions WHERE tenant=? AND finished_at IS NULL AND last_heartbeat >= ?",
            (tenant, since),
        )
        return row["n"] if row else 0

    def finish(self, session_id: str, reason: str) -> None:
        self.db.execute(
            "UPDATE sessions SET finished_at=?, finish_reason=? WHERE session_id=?", (time.time(), reason, session_id)
        )

    def list(self, tenant: str, limit: int, offset: int) -> builtins.list[Session]:
        return [
            Session.from_row(r)
            for r in self.db.all(
                "SELECT * FROM sessions WHERE tenant=? ORDER BY created_at DESC LIMIT ? OFFSET ?",
                (tenant, limit, offset),
            )
        ]

    def sampler_ids(self, session_id: str) -> builtins.list[str]:
        return [
            r["sampler_id"] for r in self.db.all("SELECT sampler_id FROM samplers WHERE session_id=?", (session_id,))
        ]


class Runs:
    def __init__(self, db):
        self.db = db

    def create(self, run: Run) -> None:
        put_row(self.db, "models", asdict(run))

    def owned(self, model_id, tenant: str) -> Run | None:
        row = _id(model_id) and self.db.one("SELECT * FROM models WHERE model_id=? AND tenant=?", (model_id, tenant))
        return Run.from_row(row) if row else None

    def get(self, model_id: str) -> Run | None:
        row = self.db.one("SELECT * FROM models WHERE model_id=?", (model_id,))
        return Run.from_row(row) if row else None

    def of_checkpoint(self, ckpt: Checkpoint) -> Run:
        """The training run a checkpoint was saved from."""
        run = self.get(ckpt.model_id)
        if run is None:
            raise NotFound(f"checkpoint {ckpt.tinker_path!r}: its training run {ckpt.model_id!r} no longer exists")
        return run

    def count_owned(self, tenant: str, model_ids: builtins.list[str]) -> int:
        if not model_ids:
            return 0
        marks = ",".join("?" for _ in model_ids)
        return self.db.one(
            f"SELECT COUNT(*) AS n FROM models WHERE tenant=? AND model_id IN ({marks})", (tenant, *model_ids)
        )["n"]

    def set_lora(self, model_id: str, lora: dict) -> None:
        self.db.execute("UPDATE models SET lora=? WHERE model_id=?", (json.dumps(lora), model_id))

    def touch(self, model_id: str) -> None:
        """Journaled: committed with the request's future (a dashboard field, not worth a write)."""
        self.db.soon([("UPDATE models SET last_request_time=? WHERE model_id=?", (time.time(), model_id))])

    def of_session(self, session_id: str) -> builtins.list[Run]:
        return [
            Run.from_row(r)
            for r in self.db.all("SELECT * FROM models WHERE session_id=? ORDER BY model_id", (session_id,))
        ]

    def list(self, tenant: str, limit: int, offset: int = 0) -> builtins.list[Run]:
        return [
            Run.from_row(r)
            for r in self.db.all(
                "SELECT * FROM models WHERE tenant=? ORDER BY created_at DESC, model_id LIMIT ? OFFSET ?",
                (tenant, limit, offset),
            )
        ]

    def count(self, tenant: str) -> int:
        return self.db.one("SELECT COUNT(*) AS n FROM models WHERE tenant=?", (tenant,))["n"]

    def forget(self, model_id: str) -> None:
        """Remove a run whose creation failed midway (it never trained: no curves, usage or checkpoints)."""
        for table in ("run_curves", "run_usage", "models"):
            self.db.execute(f"DELETE FROM {table} WHERE model_id=?", (model_id,))


class Samplers:
    def __init__(self, db):
        self.db = db

    def create(self, sampler: SamplingSession) -> None:
        put_row(self.db, "samplers", {**asdict(sampler), "ephemeral": int(sampler.ephemeral)})

    def owned(self, sampler_id, tenant: str) -> SamplingSession | None:
        row = _id(sampler_id) and self.db.one(
            "SELECT * FROM samplers WHERE sampler_id=? AND tenant=?", (sampler_id, tenant)
        )
        return SamplingSession.from_row(row) if row else None

    def of_session(self, session_id: str) -> list[SamplingSession]:
        return [
            SamplingSession.from_row(r)
            for r in self.db.all("SELECT * FROM samplers WHERE session_id=? ORDER BY created_at", (session_id,))
        ]


class Checkpoints:
    def __init__(self, db):
        self.db = db

    def put(self, ckpt: Checkpoint) -> None:
        put_row(self.db, "checkpoints", {**asdict(ckpt), "public": int(ckpt.public)})

    def _one(self, where: str, args) -> Checkpoint | None:
        row = self.db.one(f"SELECT * FROM checkpoints WHERE {where}", args)
        return Checkpoint.from_row(row) if row else None

    def _many(self, where: str, args) -> list[Checkpoint]:
        return [Checkpoint.from_row(r) for r in self.db.all(f"SELECT * FROM checkpoints WHERE {where}", args)]

    def readable(self, path, tenant: str) -> Checkpoint | None:
        """The tenant's own checkpoint, or a published one."""
        return self._one("tinker_path=? AND (tenant=? OR public=1)", (path, tenant)) if _id(path) else None

    def get(self, path: str) -> Checkpoint | None:
        return self._one("tinker_path=?", (path,))

    def owned(self, path, tenant: str) -> Checkpoint | None:
        return self._one("tinker_path=? AND tenant=?", (path, tenant)) if _id(path) else None

    def latest(self, model_id: str, kind: str) -> Checkpoint | None:
        return self._one("model_id=? AND kind=? ORDER BY created_at DESC LIMIT 1", (model_id, kind))

    def of_run(self, model_id: str, tenant: str) -> list[Checkpoint]:
        return self._many("model_id=? AND tenant=? ORDER BY created_at", (model_id, tenant))

    def of_tenant(self, tenant: str, limit: int = -1, offset: int = 0) -> list[Checkpoint]:
        return self._many("tenant=? ORDER BY created_at DESC LIMIT ? OFFSET ?", (tenant, limit, offset))

    def expired(self, tenant: str, now: float) -> list[Checkpoint]:
        return self._many("tenant=? AND expires_at IS NOT NULL AND expires_at < ?", (tenant, now))

    def count(self, tenant: str) -> int:
        return self.db.one("SELECT COUNT(*) AS n FROM checkpoints WHERE tenant=?", (tenant,))["n"]

    def delete(self, path: str) -> None:
        self.db.execute("DELETE FROM checkpoints WHERE tinker_path=?", (path,))

    def set_public(self, path: str, public: bool) -> None:
        self.db.execute("UPDATE checkpoints SET public=? WHERE tinker_path=?", (int(public), path))

    def set_expiry(self, path: str, expires_at: float | None) -> None:
        self.db.execute("UPDATE checkpoints SET expires_at=? WHERE tinker_path=?", (expires_at, path))
