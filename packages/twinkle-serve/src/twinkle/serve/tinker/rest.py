"""Tinker RestClient operations: training runs, checkpoints (list, delete, publish, TTL), weights info, sessions."""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timezone

from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.runtime import Runtime
from twinkle.serve.tinker.training import SEGMENT, parse_path


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


class TinkerRest:
    def __init__(self, rt: Runtime):
        self.rt = rt

    def _purge_expired(self, tenant: str) -> None:
        for row in self.rt.store.all("SELECT * FROM checkpoints WHERE tenant=? AND expires_at IS NOT NULL "
                                     "AND expires_at < ?", (tenant, time.time())):
            self._delete_row(row)

    def _delete_row(self, row: dict) -> None:
        shutil.rmtree(row["dir"], ignore_errors=True)
        self.rt.store.execute("DELETE FROM checkpoints WHERE tinker_path=?", (row["tinker_path"],))

    @staticmethod
    def checkpoint_json(row: dict) -> dict:
        return {"checkpoint_id": f"{SEGMENT[row['kind']]}/{row['name']}", "checkpoint_type": row["kind"],
                "time": _iso(row["created_at"]), "tinker_path": row["tinker_path"], "size_bytes": row["size_bytes"],
                "public": bool(row["public"]), "expires_at": _iso(row["expires_at"]),
                "user_metadata": json.loads(row["user_metadata"]) if row["user_metadata"] else None}

    def _run_json(self, row: dict) -> dict:
        last = {}
        for kind in ("training", "sampler"):
            c = self.rt.store.one("SELECT * FROM checkpoints WHERE model_id=? AND kind=? ORDER BY created_at DESC "
                                  "LIMIT 1", (row["model_id"], kind))
            last[kind] = self.checkpoint_json(c) if c else None
        lora = json.loads(row["lora"])
        return {"training_run_id": row["model_id"], "base_model": row["base_model"], "model_owner": row["tenant"],
                "is_lora": True, "corrupted": False, "lora_rank": lora["rank"],
                "last_request_time": _iso(row["last_request_time"]), "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"],
                "user_metadata": json.loads(row["user_metadata"]) if row["user_metadata"] else None}

    def list_runs(self, tenant: str, limit: int, offset: int) -> dict:
        total = self.rt.store.one("SELECT COUNT(*) AS n FROM models WHERE tenant=?", (tenant,))["n"]
        rows = self.rt.store.all("SELECT * FROM models WHERE tenant=? ORDER BY created_at DESC, model_id "
                                 "LIMIT ? OFFSET ?", (tenant, limit, offset))
        return {"training_runs": [self._run_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def _run(self, tenant: str, run_id: str) -> dict:
        row = self.rt.store.owned("models", "model_id", run_id, tenant)
        if row is None:
            raise NotFound(f"training run {run_id!r} not found")
        return row

    def get_run(self, tenant: str, run_id: str) -> dict:
        return self._run_json(self._run(tenant, run_id))

    def list_checkpoints(self, tenant: str, run_id: str) -> dict:
        self._run(tenant, run_id)
        self._purge_expired(tenant)
        rows = self.rt.store.all("SELECT * FROM checkpoints WHERE model_id=? AND tenant=? ORDER BY created_at",
                                 (run_id, tenant))
        return {"checkpoints": [self.checkpoint_json(r) for r in rows]}

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict:
        self._purge_expired(tenant)
        total = self.rt.store.one("SELECT COUNT(*) AS n FROM checkpoints WHERE tenant=?", (tenant,))["n"]
        rows = self.rt.store.all("SELECT * FROM checkpoints WHERE tenant=? ORDER BY created_at DESC LIMIT ? OFFSET ?",
                                 (tenant, limit, offset))
        return {"checkpoints": [self.checkpoint_json(r) for r in rows],
                "cursor": {"offset": offset, "limit": limit, "total_count": total}}

    def _checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> dict:
        path = f"tinker://{run_id}/{checkpoint_id}"
        parse_path(path)
        row = self.rt.store.owned("checkpoints", "tinker_path", path, tenant)
        if row is None:
            raise NotFound(f"checkpoint {path} not found")
        return row

    def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> None:
        self._delete_row(self._checkpoint(tenant, run_id, checkpoint_id))

    def set_public(self, tenant: str, run_id: str, checkpoint_id: str, public: bool) -> None:
        row = self._checkpoint(tenant, run_id, checkpoint_id)
        self.rt.store.execute("UPDATE checkpoints SET public=? WHERE tinker_path=?", (int(public), row["tinker_path"]))

    def set_ttl(self, tenant: str, run_id: str, checkpoint_id: str, ttl_seconds) -> None:
        row = self._checkpoint(tenant, run_id, checkpoint_id)
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds <= 0):
            raise BadRequest(f"ttl_seconds must be a positive integer or null, got {ttl_seconds!r}")
        expires = None if ttl_seconds is None else time.time() + ttl_seconds
        self.rt.store.execute("UPDATE checkpoints SET expires_at=? WHERE tinker_path=?", (expires, row["tinker_path"]))

    def weights_info(self, tenant: str, training: "object", path: str) -> dict:
        row = training.readable_checkpoint(tenant, path)
        model = self.rt.store.one("SELECT * FROM models WHERE model_id=?", (row["model_id"],))
        lora = json.loads(model["lora"])
        return {"base_model": model["base_model"], "is_lora": True, "lora_rank": lora["rank"],
                "train_unembed": lora["train_unembed"], "train_mlp": lora["train_mlp"],
                "train_attn": lora["train_attn"]}

    def list_sessions(self, tenant: str, limit: int, offset: int) -> dict:
        rows = self.rt.store.all("SELECT session_id FROM sessions WHERE tenant=? ORDER BY created_at DESC "
                                 "LIMIT ? OFFSET ?", (tenant, limit, offset))
        return {"sessions": [r["session_id"] for r in rows]}

    def get_session(self, tenant: str, session_id: str) -> dict:
        row = self.rt.store.owned("sessions", "session_id", session_id, tenant)
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        runs = self.rt.store.all("SELECT model_id FROM models WHERE session_id=?", (session_id,))
        samplers = self.rt.store.all("SELECT sampler_id FROM samplers WHERE session_id=?", (session_id,))
        meta = json.loads(row["user_metadata"]) if row["user_metadata"] else None
        return {"training_run_ids": [r["model_id"] for r in runs], "sampler_ids": [r["sampler_id"] for r in samplers],
                "user_metadata": {str(k): str(v) for k, v in meta.items()} if meta else None}
