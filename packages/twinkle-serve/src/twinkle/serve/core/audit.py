"""The audit log: per key, who did what to its checkpoints and projects (Tinker's `get_audit_log`).

A key here stands for Tinker's organization. Events are named `<resource>_<action>`, as the SDK's
`AuditLogEntry.event` documents: `checkpoint_create`, `checkpoint_read`, `checkpoint_delete`,
`checkpoint_publish`, `checkpoint_unpublish`, `checkpoint_ttl_set`, `project_assign`. A read of a
published checkpoint by another key is logged for both keys; the owner's entry says only that another
key read it, never which one (keys do not learn of each other through this server).
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from twinkle.serve.core.records import Checkpoint
from twinkle.serve.errors import BadRequest

# Tinker's event_type filter -> the event-name prefix it selects (no teams or organizations here: empty)
EVENT_TYPES = {"all": "", "checkpoints": "checkpoint_", "projects": "project_", "teams": "team_"}
EVENT_TYPES["organizations"] = "organization_"


def checkpoint_event(store, event: str, ckpt: Checkpoint, **details) -> None:
    store.audit.add(ckpt.tenant, event, {"tinker_path": ckpt.tinker_path, "model_id": ckpt.model_id, **details})


def checkpoint_read(store, reader: str, ckpt: Checkpoint, purpose: str) -> None:
    """`reader` loaded `ckpt`'s files (for `purpose`: load, sample, copy, download)."""
    details = {"tinker_path": ckpt.tinker_path, "model_id": ckpt.model_id, "purpose": purpose}
    store.audit.add(reader, "checkpoint_read", {**details, "actor": "this key"})
    if ckpt.tenant != reader:
        store.audit.add(ckpt.tenant, "checkpoint_read", {**details, "actor": "another key (published checkpoint)"})


def project_assigned(store, tenant: str, session_id: str, project_id: str) -> None:
    store.audit.add(tenant, "project_assign", {"session_id": session_id, "project_id": project_id})


def entries(store, tenant: str, event_type: str = "all", day: str | None = None) -> dict:
    """GET /api/v1/audit: `tenant`'s events of one UTC day (default today), oldest first."""
    if event_type not in EVENT_TYPES:
        raise BadRequest(f"event_type must be one of {sorted(EVENT_TYPES)}, got {event_type!r}")
    try:
        when = date.fromisoformat(day) if day is not None else datetime.now(UTC).date()
    except ValueError:
        raise BadRequest(f"day must be a date as YYYY-MM-DD, got {day!r}") from None
    start = datetime(when.year, when.month, when.day, tzinfo=UTC)
    rows = store.audit.between(
        tenant, start.timestamp(), (start + timedelta(days=1)).timestamp(), EVENT_TYPES[event_type]
    )
    return {"entries": [_entry(row) for row in rows]}


def _entry(row: dict) -> dict:
    details = row["details"]
    entry = {
        "timestamp": datetime.fromtimestamp(row["t"], UTC).isoformat(),
        "event": row["event"],
        "event_details": details,
    }
    if row["event"].startswith("checkpoint_"):  # the SDK's deprecated top-level copies, for older readers
        entry.update(model_id=details.get("model_id"), tinker_path=details.get("tinker_path"))
        entry["purpose"] = details.get("purpose")
    return entry
