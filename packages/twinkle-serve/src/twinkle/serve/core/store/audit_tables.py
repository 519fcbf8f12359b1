"""SQL for the audit log (schema V8): one row per event that a key's checkpoints or projects saw."""

from __future__ import annotations

import json
import time

RETENTION_S = 30 * 86400  # a month of events per key; older rows are dropped as new ones arrive
PRUNE_EVERY_S = 3600.0
KEEP_PER_KEY = 10_000  # and at most this many per key: a key's own requests must not grow the store without bound


class AuditEvents:
    def __init__(self, db):
        self.db = db
        self._pruned_at = 0.0
        self._added: dict[str, int] = {}  # events added per key since its last trim

    def add(self, tenant: str, event: str, details: dict) -> None:
        now = time.time()
        # committed now, not journaled: a read of a published checkpoint is what its owner audits for
        self.db.execute(
            "INSERT INTO audit_events (tenant, t, event, details) VALUES (?, ?, ?, ?)",
            (tenant, now, event, json.dumps(details, sort_keys=True)),
        )
        if now - self._pruned_at > PRUNE_EVERY_S:
            self._pruned_at = now
            self.db.execute("DELETE FROM audit_events WHERE t < ?", (now - RETENTION_S,))
        self._added[tenant] = self._added.get(tenant, 0) + 1
        if self._added[tenant] >= KEEP_PER_KEY // 10:
            self._added[tenant] = 0
            self.db.execute(
                "DELETE FROM audit_events WHERE rowid IN (SELECT rowid FROM audit_events WHERE tenant=? "
                "ORDER BY t DESC, rowid DESC LIMIT -1 OFFSET ?)",
                (tenant, KEEP_PER_KEY),
            )

    def between(self, tenant: str, start: float, end: float, prefix: str = "") -> list[dict]:
        """`tenant`'s events in [start, end) whose name starts with `prefix`, oldest first."""
        rows = self.db.all(
            "SELECT t, event, details FROM audit_events WHERE tenant=? AND t >= ? AND t < ? "
            "AND substr(event, 1, ?) = ? ORDER BY t, rowid",
            (tenant, start, end, len(prefix), prefix),
        )
        return [{**row, "details": json.loads(row["details"])} for row in rows]
