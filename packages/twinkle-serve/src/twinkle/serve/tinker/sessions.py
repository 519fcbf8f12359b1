"""Session search, projects and trace export, and `copy_weights` (Tinker RestClient, SDK 0.38).

Projects are labels a tenant puts on its sessions (`default` until set); a tenant sees only its own
sessions, so the owner filters `own` and `accessible` mean the same here. Display names are not
recorded by this server, so searching by one is refused rather than answered with no matches.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from datetime import UTC, datetime

from twinkle.serve.core import audit
from twinkle.serve.core.service import LIVE_SESSION_S, Service
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker.usage import session_metadata


def owner_urn(tenant: str) -> str:
    return f"twinkle:key:{tenant}"


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def _status(row: dict) -> dict | None:
    if row["finished_at"] is not None:
        return {"type": "client_finished", "reason": {"type": row["finish_reason"] or "success"}}
    if row["last_heartbeat"] and time.time() - row["last_heartbeat"] < LIVE_SESSION_S:
        return {"type": "active"}
    return None


def _matches(row: dict, body: b.SessionSearchBody, tenant: str) -> bool:
    if body.session_id is not None and row["session_id"] != body.session_id:
        return False
    if body.project_ids is not None and row["project_id"] not in body.project_ids:
        return False
    meta = json.loads(row["user_metadata"]) if row["user_metadata"] else {}
    if any(str(meta.get(k)) != v or k not in meta for k, v in body.user_metadata.items()):
        return False
    if body.owner.type == "user" and owner_urn(tenant) not in (body.owner.owner_urns or []):
        return False
    if body.statuses is None:
        return True
    status = _status(row)
    for query in body.statuses:
        if (
            status is not None
            and query.type == status["type"]
            and (query.type != "client_finished" or not query.reasons or status["reason"]["type"] in query.reasons)
        ):
            return True
    return False


def search(svc: Service, tenant: str, body: b.SessionSearchBody) -> dict:
    if body.display_name is not None:
        raise BadRequest(
            "display_name: this server does not record session display names; search by session_id or user_metadata"
        )
    rows = [r for r in svc.store.projects.sessions_with_details(tenant) if _matches(r, body, tenant)]
    cursor = body.cursor
    if cursor is not None:  # newest first: resume after the last (created_at, session_id) returned
        try:
            after = (datetime.fromisoformat(cursor.last_created_at).timestamp(), cursor.last_session_id)
        except ValueError:
            raise BadRequest(f"cursor.last_created_at is not a timestamp: {cursor.last_created_at!r}") from None
        rows = [r for r in rows if (round(r["created_at"], 6), r["session_id"]) < (round(after[0], 6), after[1])]
    page = rows[: body.limit]
    summaries = [
        {
            "session_id": r["session_id"],
            "created_at": _iso(r["created_at"]),
            "owner": owner_urn(tenant),
            "project_id": r["project_id"],
            "status": _status(r),
            "checkpoints_count": r["checkpoints_count"],
            "display_name": None,
            "user_metadata": session_metadata(svc.store, r["session_id"]),
            "checkpoint_storage_bytes": r["checkpoint_bytes"],
        }
        for r in page
    ]
    more = len(rows) > len(page)
    return {
        "sessions": summaries,
        "next_cursor": {"last_created_at": summaries[-1]["created_at"], "last_session_id": page[-1]["session_id"]}
        if more
        else None,
    }


def set_project(svc: Service, tenant: str, session_id: str, body: b.ProjectBody) -> dict:
    svc.session(tenant, session_id)
    project = body.project_id
    if not project:
        raise BadRequest("project_id is required (a non-empty string)")
    svc.store.projects.set(session_id, project)
    audit.project_assigned(svc.store, tenant, session_id, project)
    return {"session_id": session_id, "project_id": project}


def trace_url(svc: Service, signer, tenant: str, session_id: str, base_url: str) -> dict:
    """The session's trace is built at download time from the store: always up to date, never pending."""
    svc.session(tenant, session_id)
    token = signer.token(session_id, int(time.time()) + 3600)
    return {"status": "ready", "url": f"{base_url.rstrip('/')}/api/v1/session_traces/{token}"}


def trace(svc: Service, signer, token: str) -> bytes:
    """A Chrome trace-event JSON (Perfetto opens it): what the server recorded of the session."""
    session_id, _ = signer.open(token)
    session, store = svc.store.sessions.get(session_id), svc.store
    if session is None:
        raise NotFound(f"session {session_id!r} no longer exists")
    runs = store.runs.of_session(session_id)
    checkpoints = [c for run in runs for c in store.checkpoints.of_run(run.model_id, session.tenant)]

    def instant(name, ts, **args):
        return {"name": name, "ph": "i", "s": "p", "ts": int(ts * 1e6), "pid": 1, "tid": 1, "args": args}

    events = [instant("session created", session.created_at, session_id=session_id)]
    events += [
        instant("training run created", m.created_at, model_id=m.model_id, base_model=m.base_model) for m in runs
    ]
    events += [
        instant("sampler created", s.created_at, sampler_id=s.sampler_id, model_path=s.model_path)
        for s in store.samplers.of_session(session_id)
    ]
    events += [
        instant(f"{c.kind} checkpoint saved", c.created_at, tinker_path=c.tinker_path, size_bytes=c.size_bytes)
        for c in checkpoints
    ]
    events += [
        {
            "name": f"{u['kind']} tokens",
            "ph": "C",
            "ts": int(u["hour"] * 1e6),
            "pid": 1,
            "args": {"tokens": u["tokens"]},
        }
        for u in store.usage.of_session(session_id)
    ]
    if session.finished_at is not None:
        events.append(instant("session finished", session.finished_at, reason=session.finish_reason))
    events.sort(key=lambda e: e["ts"])
    return json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode()


def copy_weights(svc: Service, weights, tenant: str, body: b.CopyWeightsBody) -> dict:
    if body.weights_access_token:
        raise BadRequest("weights_access_token is not supported by this server: publish the checkpoint instead")
    source = svc.checkpoints.readable(tenant, body.source_path, purpose="copy")
    ttl = body.ttl_seconds  # in range: a positive integer the calendar can hold
    session_id, seq = body.session_id, body.model_seq_id
    if session_id is not None:
        svc.session(tenant, session_id)
        if seq is None or seq < 0:
            raise BadRequest("model_seq_id (an integer >= 0) is required with session_id")
    else:
        project = body.destination_project_id
        if not project:
            raise BadRequest("copy_weights needs destination_project_id, or session_id and model_seq_id")
        # the copy's own session, finished at once: every run here belongs to a session
        session = svc.create_session(tenant, ["copy_weights"], {"created_by": "copy_weights"})
        session_id, seq = session.session_id, 0
        svc.store.sessions.create(replace(session, finished_at=time.time(), finish_reason="success"))
        svc.store.projects.set(session_id, project)
        audit.project_assigned(svc.store, tenant, session_id, project)
    model_id = f"{session_id}:train:{seq}"
    if svc.store.runs.get(model_id) is not None:
        raise BadRequest(f"training run {model_id!r} already exists; use another model_seq_id")
    return {"tinker_path": weights.copy_checkpoint(tenant, source, model_id, session_id, ttl)}
