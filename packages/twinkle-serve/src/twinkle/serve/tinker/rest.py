"""Tinker RestClient operations: training runs, checkpoints (list, delete, publish, TTL), weights info, sessions."""

from __future__ import annotations

from datetime import UTC, datetime

from twinkle.serve.core import audit
from twinkle.serve.core.records import Checkpoint, Run
from twinkle.serve.core.service import Service
from twinkle.serve.errors import NotFound


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat()


def checkpoint_json(c: Checkpoint) -> dict:
    return {
        "checkpoint_id": c.checkpoint_id,
        "checkpoint_type": c.kind,
        "time": _iso(c.created_at),
        "tinker_path": c.tinker_path,
        "size_bytes": c.size_bytes,
        "public": c.public,
        "expires_at": _iso(c.expires_at),
        "user_metadata": c.user_metadata or None,
    }


class TinkerRest:
    def __init__(self, svc: Service):
        self.svc, self.store = svc, svc.store

    def _run_json(self, run: Run) -> dict:
        last = {kind: self.store.checkpoints.latest(run.model_id, kind) for kind in ("training", "sampler")}
        return {
            "training_run_id": run.model_id,
            "base_model": run.base_model,
            "model_owner": run.tenant,
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora.get("rank"),
            "last_request_time": _iso(run.last_request_time),
            "last_checkpoint": checkpoint_json(last["training"]) if last["training"] else None,
            "last_sampler_checkpoint": checkpoint_json(last["sampler"]) if last["sampler"] else None,
            "user_metadata": run.user_metadata or None,
        }

    def list_runs(self, tenant: str, limit: int, offset: int) -> dict:
        runs = self.store.runs.list(tenant, limit, offset)
        return {
            "training_runs": [self._run_json(r) for r in runs],
            "cursor": {"offset": offset, "limit": limit, "total_count": self.store.runs.count(tenant)},
        }

    def _run(self, tenant: str, run_id: str) -> Run:
        run = self.store.runs.owned(run_id, tenant)
        if run is None:
            raise NotFound(f"training run {run_id!r} not found")
        return run

    def get_run(self, tenant: str, run_id: str) -> dict:
        return self._run_json(self._run(tenant, run_id))

    def list_checkpoints(self, tenant: str, run_id: str) -> dict:
        self._run(tenant, run_id)
        return {"checkpoints": [checkpoint_json(c) for c in self.svc.checkpoints.of_run(tenant, run_id)]}

    def list_user_checkpoints(self, tenant: str, limit: int, offset: int) -> dict:
        rows = self.svc.checkpoints.of_tenant(tenant, limit, offset)
        return {
            "checkpoints": [checkpoint_json(c) for c in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": self.store.checkpoints.count(tenant)},
        }

    def delete_checkpoint(self, tenant: str, run_id: str, checkpoint_id: str) -> None:
        self.svc.checkpoints.delete(self.svc.checkpoints.owned(tenant, run_id, checkpoint_id))

    def set_public(self, tenant: str, run_id: str, checkpoint_id: str, public: bool) -> None:
        ckpt = self.svc.checkpoints.owned(tenant, run_id, checkpoint_id)
        self.store.checkpoints.set_public(ckpt.tinker_path, public)
        audit.checkpoint_event(self.store, "checkpoint_publish" if public else "checkpoint_unpublish", ckpt)

    def set_ttl(self, tenant: str, run_id: str, checkpoint_id: str, ttl_seconds) -> None:
        self.svc.checkpoints.set_ttl(self.svc.checkpoints.owned(tenant, run_id, checkpoint_id), ttl_seconds)

    def weights_info(self, tenant: str, path: str) -> dict:
        run = self.store.runs.of_checkpoint(self.svc.checkpoints.readable(tenant, path))
        lora = run.lora
        return {
            "base_model": run.base_model,
            "is_lora": True,
            "lora_rank": lora.get("rank"),
            "train_unembed": lora.get("train_unembed", False),
            "train_mlp": lora.get("train_mlp", True),
            "train_attn": lora.get("train_attn", True),
        }

    def list_sessions(self, tenant: str, limit: int, offset: int) -> dict:
        return {"sessions": [s.session_id for s in self.store.sessions.list(tenant, limit, offset)]}

    def get_session(self, tenant: str, session_id: str) -> dict:
        session = self.svc.session(tenant, session_id)
        return {
            "training_run_ids": [r.model_id for r in self.store.runs.of_session(session_id)],
            "sampler_ids": self.store.sessions.sampler_ids(session_id),
            "user_metadata": {str(k): str(v) for k, v in session.user_metadata.items()} or None,
        }
