"""Usage, counted in real tokens per API key, and the key's own record (Tinker billing / auth routes).

Counted by the service core (`twinkle.serve.core.usage`, through `Service.count_training`/`count_sampling`) where the work completes, in
both APIs: training tokens (model input tokens of every forward and
forward_backward that succeeded, custom losses included), sampling prefill tokens (each sample
request's prompt) and sampled tokens (every returned sequence), in UTC-hour buckets. Prices and storage
GB-hours are not kept here: they are answered as null, never with invented figures. The audit log is
the core's (`twinkle.serve.core.audit`).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from twinkle.serve.errors import BadRequest

MAX_WINDOW = timedelta(days=14)
GB = 1e9


def session_metadata(store, session_id: str) -> dict | None:
    session = store.sessions.get(session_id)
    return {str(k): str(v) for k, v in session.user_metadata.items()} if session and session.user_metadata else None


def _time(name: str, value: str | None) -> datetime:
    if not value:
        raise BadRequest(f"{name} is required (an RFC 3339 timestamp, e.g. 2026-07-13T00:00:00Z)")
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name} must be an RFC 3339 timestamp, got {value!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


def usage_events(store, tenant: str, starting_on: str | None, ending_before: str | None) -> dict:
    start, end = _time("starting_on", starting_on), _time("ending_before", ending_before)
    if end <= start:
        raise BadRequest("ending_before must be after starting_on")
    if end - start > MAX_WINDOW:
        raise BadRequest(f"the window from starting_on to ending_before is at most {MAX_WINDOW.days} days")
    rows = store.usage.buckets(tenant, start.timestamp() // 3600 * 3600, end.timestamp())
    sessions = {r["session_id"] for r in rows if r["session_id"]}
    data = []
    for r in rows:
        info = {"type": r["kind"], "token_count": r["tokens"]}
        if r["kind"] == "sampling_prefill":
            info["cached"] = False  # this server has no prefill cache
        session = r["session_id"] or None
        data.append(
            {
                "bucket_start": _iso(r["hour"]),
                "bucket_end": _iso(r["hour"] + 3600),
                "base_model": r["base_model"],
                "user_id": f"twinkle:key:{tenant}",
                "user_name": tenant,
                "session_id": session,
                "project_id": store.projects.of(session) if session else None,
                "estimated_cost_usd": None,
                "effective_rate_usd_per_million_tokens": None,
                "event_info": info,
            }
        )
    return {
        "data": data,
        "sessions": {s: {"user_metadata": session_metadata(store, s)} for s in sessions},
        "cost_data_through": None,
    }


def checkpoint_storage(store, tenant: str, project_id: str | None) -> dict:
    totals = store.projects.checkpoint_storage(tenant, project_id)
    item = {
        "project_id": project_id,
        "org_user_urn": f"twinkle:key:{tenant}",
        "user_email": None,
        "user_name": tenant,
        "checkpoint_count": totals["n"],
        "size_bytes": totals["size"],
        "size_gigabytes": totals["size"] / GB,
        "estimated_monthly_cost_usd": None,
    }
    return {"effective_rate_usd_per_gigabyte_month": None, "data": [item] if totals["n"] else []}


def api_key_record(store, tenant: str) -> dict:
    """GET /auth/apikey/me: the caller's key as `tinker auth login` expects it (no email: keys here name a
    tenant, not a person)."""
    row = store.keys.row(tenant)
    return {
        "key_id": row["key_id"],
        "name": row["name"],
        "note": f"twinkle-server key of tenant {tenant!r}",
        "details": {
            "org_details": {"name": "twinkle-server"},
            "user_details": {"email": f"(no email: tenant {tenant})"},
        },
    }
