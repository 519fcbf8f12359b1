"""SQL for the server's own bookkeeping: API keys, futures, idempotent answers, run curves.

Futures, answers and curve points are journaled (`Db.soon`, committed with the next write or the
scheduler's per-pass flush); until their commit each table answers reads of them from memory, so
a journaled row reads the same as a committed one in this process.
"""

from __future__ import annotations

import builtins  # the stores have a `list` method, which shadows the builtin in class scope
import threading
import time

from twinkle.serve.core.records import FutureRow


class Keys:
    def __init__(self, db):
        self.db = db

    def active(self, name: str) -> bool:
        return self.db.one("SELECT name FROM api_keys WHERE name=? AND revoked_at IS NULL", (name,)) is not None

    def add(self, name: str, key_hash: str, role: str = "tenant") -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO api_keys (name, key_hash, created_at, revoked_at, role) VALUES (?, ?, ?, NULL, ?)",
            (name, key_hash, time.time(), role),
        )

    def list(self) -> builtins.list[dict]:
        return self.db.all("SELECT name, created_at, revoked_at, role FROM api_keys ORDER BY created_at")

    def role_for(self, key_hash: str) -> str | None:
        """'tenant' or 'operator' for a valid, unrevoked key; None otherwise."""
        row = self.db.one("SELECT role FROM api_keys WHERE key_hash=? AND revoked_at IS NULL", (key_hash,))
        return row["role"] if row else None

    def row(self, name: str) -> dict | None:
        """An active key's record (its id is the row number)."""
        return self.db.one(
            "SELECT rowid AS key_id, name, created_at FROM api_keys WHERE name=? AND revoked_at IS NULL", (name,)
        )

    def revoke(self, name: str) -> bool:
        return (
            self.db.execute("UPDATE api_keys SET revoked_at=? WHERE name=? AND revoked_at IS NULL", (time.time(), name))
            > 0
        )

    def tenant_for(self, key_hash: str) -> str | None:
        row = self.db.one("SELECT name FROM api_keys WHERE key_hash=? AND revoked_at IS NULL", (key_hash,))
        return row["name"] if row else None

    def count_active(self) -> int:
        return self.db.one("SELECT COUNT(*) AS n FROM api_keys WHERE revoked_at IS NULL")["n"]


class Futures:
    def __init__(self, db):
        self.db = db
        # request id -> (tenant, created_at) of futures created but not yet committed
        self._journaled: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def fail_pending(self, content_type: str, payload: bytes) -> None:
        self.db.execute(
            "UPDATE futures SET status='failed', content_type=?, payload=?, completed_at=? WHERE status='pending'",
            (content_type, payload, time.time()),
        )

    def start_boot(self, boot_id: str) -> None:
        self.db.execute("INSERT INTO boots (boot_id, started_at) VALUES (?, ?)", (boot_id, time.time()))

    def was_boot(self, boot_id: str) -> bool:
        return self.db.one("SELECT boot_id FROM boots WHERE boot_id=?", (boot_id,)) is not None

    def create(self, request_id: str, tenant: str) -> None:
        """Journaled: the pass that runs it commits it (with its result), or the next write does."""
        now = time.time()
        with self._lock:
            self._journaled[request_id] = (tenant, now)
            self.db.outstanding += 1
        self.db.soon(
            [
                (
                    "INSERT INTO futures (request_id, tenant, status, created_at) VALUES (?, ?, 'pending', ?)",
                    (request_id, tenant, now),
                )
            ],
            done=lambda: self._committed(request_id),
        )

    def _committed(self, request_id: str) -> None:
        with self._lock:
            self._journaled.pop(request_id, None)

    def finish(self, request_id: str, status: str, content_type: str, payload: bytes) -> None:
        """Journaled: the caller flushes before anyone can be told (FutureHub)."""
        with self._lock:
            self.db.outstanding -= 1
        self.db.soon(
            [
                (
                    "UPDATE futures SET status=?, content_type=?, payload=?, completed_at=? WHERE request_id=?",
                    (status, content_type, payload, time.time(), request_id),
                )
            ]
        )

    def get(self, request_id, tenant: str) -> FutureRow | None:
        if not isinstance(request_id, str):
            return None
        # read before the table: a row committed (and dropped from memory) meanwhile is then in it
        with self._lock:
            journaled = self._journaled.get(request_id)
        row = self.db.one(
            "SELECT request_id, status, content_type, payload FROM futures WHERE request_id=? AND tenant=?",
            (request_id, tenant),
        )
        if row:
            return FutureRow(**row)
        return FutureRow(request_id, "pending") if journaled is not None and journaled[0] == tenant else None

    def pending(self, tenant: str) -> tuple[int, int]:
        """(pending futures on the server, of them this tenant's)."""
        with self._lock:
            owners = [owner for owner, _ in self._journaled.values()]
        row = self.db.one("SELECT COUNT(*) AS n, SUM(tenant=?) AS mine FROM futures WHERE status='pending'", (tenant,))
        return (row["n"] or 0) + len(owners), (row["mine"] or 0) + owners.count(tenant)

    def prune(self, before: float) -> int:
        """Retire futures finished before `before` (their results were retrievable for the whole
        retention window), and the sampling-queue rows that named them; pending ones always stay.
        -> futures removed."""
        removed = self.db.execute("DELETE FROM futures WHERE status != 'pending' AND completed_at < ?", (before,))
        self.db.execute("DELETE FROM sample_requests WHERE request_id NOT IN (SELECT request_id FROM futures)")
        return removed

    def count(self) -> int:
        with self._lock:
            journaled = len(self._journaled)
        return self.db.one("SELECT COUNT(*) AS n FROM futures")["n"] + journaled

    def oldest_pending(self) -> float | None:
        """When the longest-waiting unfinished request was submitted (the operator page's queue age)."""
        with self._lock:
            times = [t for _, t in self._journaled.values()]
        stored = self.db.one("SELECT MIN(created_at) AS t FROM futures WHERE status='pending'")["t"]
        return min(times + ([stored] if stored is not None else []), default=None)

    def completed_since(self, t: float) -> int:
        return self.db.one("SELECT COUNT(*) AS n FROM futures WHERE completed_at > ?", (t,))["n"]


class Idempotency:
    def __init__(self, db):
        self.db = db
        self._journaled: dict[tuple[str, str], dict] = {}  # answers not yet committed
        self._lock = threading.Lock()

    def purge(self, before: float) -> None:
        self.db.execute("DELETE FROM idempotency WHERE created_at < ?", (before,))

    def trim(self, keep_rows: int) -> int:
        """Keep only the newest `keep_rows` answers (rowids grow with every write); -> rows removed."""
        return self.db.execute(
            "DELETE FROM idempotency WHERE rowid <= (SELECT rowid FROM idempotency ORDER BY rowid DESC "
            "LIMIT 1 OFFSET ?)",
            (keep_rows,),
        )

    def count(self) -> int:
        with self._lock:
            journaled = len(self._journaled)
        return self.db.one("SELECT COUNT(*) AS n FROM idempotency")["n"] + journaled

    def get(self, tenant: str, key: str) -> dict | None:
        with self._lock:
            journaled = self._journaled.get((tenant, key))
        return journaled or self.db.one(
            "SELECT fingerprint, status, content_type, body FROM idempotency WHERE tenant=? AND key=?", (tenant, key)
        )

    def put(self, tenant: str, key: str, fingerprint: str, status: int, content_type: str, body: bytes) -> None:
        """Journaled: a submission's answer is committed with its future (or by the next write). Lost
        only to a kill before that commit, when the retry then runs afresh (idempotency.py)."""
        slot = (tenant, key)
        answer = {"fingerprint": fingerprint, "status": status, "content_type": content_type, "body": body}
        with self._lock:
            self._journaled[slot] = answer
        self.db.soon(
            [
                (
                    "INSERT OR REPLACE INTO idempotency (tenant, key, fingerprint, status, content_type, body, "
                    "created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (tenant, key, fingerprint, status, content_type, body, time.time()),
                )
            ],
            done=lambda: self._committed(slot, answer),
        )

    def _committed(self, slot: tuple[str, str], answer: dict) -> None:
        with self._lock:
            if self._journaled.get(slot) is answer:
                del self._journaled[slot]


class Curves:
    def __init__(self, db):
        self.db = db
        # (model_id, tenant, step, metrics) after each point is stored: the server's trackers listen here.
        self.on_add = None
        # points per (run, name) past which the older half is thinned to every other point (caps.max_curve_points)
        self.max_points = 100_000
        self._journaled: dict[tuple[str, str], dict] = {}  # (run, name) -> its newest point not yet committed
        self._lock = threading.Lock()

    def add(self, model_id: str, tenant: str, step: int | None, metrics: dict[str, float]) -> None:
        """Journaled (committed with the pass's other rows); `last` sees the point at once."""
        now = time.time()
        points = {name: {"step": step, "value": float(v)} for name, v in metrics.items() if v is not None}
        with self._lock:
            self._journaled.update({(model_id, name): p for name, p in points.items()})
        sql = "INSERT INTO run_curves (model_id, tenant, step, name, value, t) VALUES (?, ?, ?, ?, ?, ?)"
        self.db.soon(
            [(sql, (model_id, tenant, step, name, p["value"], now)) for name, p in points.items()],
            done=lambda: self._committed(model_id, points),
        )
        if isinstance(step, int) and step % 1000 == 0:  # a count every 1000 steps, not every point
            for name in metrics:
                self._thin(model_id, name)
        if self.on_add is not None:
            self.on_add(model_id, tenant, step, {k: float(v) for k, v in metrics.items() if v is not None})

    def _committed(self, model_id: str, points: dict[str, dict]) -> None:
        with self._lock:
            for name, point in points.items():
                if self._journaled.get((model_id, name)) is point:
                    del self._journaled[(model_id, name)]

    def rows(self) -> int:
        return self.db.one("SELECT COUNT(*) AS n FROM run_curves")["n"]

    def _thin(self, model_id: str, name: str) -> None:
        """Past max_points, drop every other point of the older half: the curve keeps its shape and its
        recent detail, and its rows stay bounded however long the run trains."""
        if self.count(model_id, name) <= self.max_points:
            return
        self.db.execute(
            "DELETE FROM run_curves WHERE rowid IN (SELECT rowid FROM (SELECT rowid, ROW_NUMBER() OVER "
            "(ORDER BY step, t) AS i FROM run_curves WHERE model_id=? AND name=? ORDER BY step, t LIMIT ?) "
            "WHERE i % 2 = 0)",
            (model_id, name, self.max_points // 2),
        )

    def of(self, model_id: str, since_step: int = -1) -> dict[str, list[dict]]:
        self.db.flush()  # the journaled points too (a no-op when there are none)
        out: dict[str, list[dict]] = {}
        for row in self.db.all(
            "SELECT step, name, value, t FROM run_curves WHERE model_id=? AND step>? ORDER BY step, t",
            (model_id, since_step),
        ):
            out.setdefault(row["name"], []).append({"step": row["step"], "value": row["value"], "t": row["t"]})
        return out

    def last(self, model_id: str, name: str) -> dict | None:
        with self._lock:
            journaled = self._journaled.get((model_id, name))
        return journaled or self.db.one(
            "SELECT step, value FROM run_curves WHERE model_id=? AND name=? ORDER BY step DESC, t DESC LIMIT 1",
            (model_id, name),
        )

    def count(self, model_id: str, name: str, before: float | None = None) -> int:
        """Points of one curve (recorded at or before time `before`, when given)."""
        self.db.flush()  # the journaled points too (a no-op when there are none)
        if before is None:
            sql, args = "SELECT COUNT(*) AS n FROM run_curves WHERE model_id=? AND name=?", (model_id, name)
        else:
            sql = "SELECT COUNT(*) AS n FROM run_curves WHERE model_id=? AND name=? AND t <= ?"
            args = (model_id, name, before)
        return self.db.one(sql, args)["n"]

    def names(self, model_id: str) -> set[str]:
        """The run's curve names (the index on (model_id, name, step) answers it)."""
        self.db.flush()  # the journaled points too (a no-op when there are none)
        return {r["name"] for r in self.db.all("SELECT DISTINCT name FROM run_curves WHERE model_id=?", (model_id,))}

    def max_step(self, model_id: str) -> int:
        self.db.flush()  # the journaled points too (a no-op when there are none)
        row = self.db.one("SELECT MAX(step) AS s FROM run_curves WHERE model_id=?", (model_id,))
        return row["s"] or 0
