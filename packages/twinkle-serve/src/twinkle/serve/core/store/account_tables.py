"""SQL for the SDK 0.38 extras (schema V3): custom losses, the sampling completion queue, session
projects and search, and token usage per UTC hour (counted by both APIs); per-run usage and per-key
quotas (schema V4)."""

from __future__ import annotations

import json
import time

from twinkle.serve.core.store.objects import put_row


class CustomLosses:
    def __init__(self, db):
        self.db = db

    def put(self, loss_id: str, tenant: str, session_id: str, name: str, inputs, graph) -> None:
        put_row(
            self.db,
            "custom_losses",
            {
                "loss_id": loss_id,
                "tenant": tenant,
                "session_id": session_id,
                "name": name,
                "inputs": inputs,
                "graph": graph,
                "created_at": time.time(),
            },
        )

    def owned(self, loss_id, tenant: str) -> dict | None:
        """(name, inputs, graph, session_id) of the tenant's loss, JSON decoded; None otherwise."""
        row = isinstance(loss_id, str) and self.db.one(
            "SELECT * FROM custom_losses WHERE loss_id=? AND tenant=?", (loss_id, tenant)
        )
        return {**row, "inputs": json.loads(row["inputs"]), "graph": json.loads(row["graph"])} if row else None

    def stamp(self, loss_id, tenant: str) -> tuple[str, float] | None:
        """(session_id, created_at) of the tenant's loss, without decoding it: what a parsed copy is checked by."""
        row = isinstance(loss_id, str) and self.db.one(
            "SELECT session_id, created_at FROM custom_losses WHERE loss_id=? AND tenant=?", (loss_id, tenant)
        )
        return (row["session_id"], row["created_at"]) if row else None


class SampleRequests:
    """Which sampler (and clone) each sample request came from, numbered in the order first seen finished."""

    def __init__(self, db):
        self.db = db

    def record(self, request_id: str, tenant: str, sampler_id: str, clone: int) -> None:
        put_row(
            self.db,
            "sample_requests",
            {"request_id": request_id, "tenant": tenant, "sampler_id": sampler_id, "clone": clone, "completion": None},
        )

    def owned(self, request_id, tenant: str) -> bool:
        return (
            isinstance(request_id, str)
            and self.db.one(
                "SELECT request_id FROM sample_requests WHERE request_id=? AND tenant=?", (request_id, tenant)
            )
            is not None
        )

    def completions(self, tenant: str, sampler_id: str, clone: int, after: int) -> tuple[list, list]:
        """-> (finished requests numbered after `after`, in completion order, with status and payload size;
        request ids still pending). A request is numbered once, the first time it is seen finished."""
        self.db.flush()  # a just-queued request's future may still be journaled: join the committed table
        rows = self.db.all(
            "SELECT s.request_id, s.completion, f.status, LENGTH(f.payload) AS size FROM sample_requests s "
            "JOIN futures f ON f.request_id = s.request_id WHERE s.tenant=? AND s.sampler_id=? "
            "AND s.clone=? AND (s.completion IS NULL OR s.completion > ?) ORDER BY f.completed_at",
            (tenant, sampler_id, clone, after),
        )
        for row in rows:
            if row["completion"] is None and row["status"] != "pending":
                numbered = self.db.all(
                    "UPDATE sample_requests SET completion = (SELECT COALESCE(MAX(completion), 0) "
                    "+ 1 FROM sample_requests) WHERE request_id=? AND completion IS NULL "
                    "RETURNING completion",
                    (row["request_id"],),
                )
                row["completion"] = (
                    numbered[0]["completion"]
                    if numbered
                    else self.db.one("SELECT completion FROM sample_requests WHERE request_id=?", (row["request_id"],))[
                        "completion"
                    ]
                )
        done = sorted((r for r in rows if r["status"] != "pending"), key=lambda r: r["completion"])
        return done, [r["request_id"] for r in rows if r["status"] == "pending"]

    def forget(self, tenant: str, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.db.execute("DELETE FROM sample_requests WHERE request_id=? AND tenant=?", (request_id, tenant))

    def join(self, sampler_id: str) -> int:
        """The next client number of a sampling session (its original client is 0)."""
        return self.db.all(
            "INSERT INTO sampler_clients (sampler_id, clients) VALUES (?, 1) ON CONFLICT(sampler_id) "
            "DO UPDATE SET clients = clients + 1 RETURNING clients",
            (sampler_id,),
        )[0]["clients"]


class Usage:
    def __init__(self, db):
        self.db = db

    def add(
        self,
        tenant: str,
        session_id: str | None,
        base_model: str,
        counts: dict[str, int],
        model_id: str | None,
        soon: bool = False,
    ) -> None:
        """Count tokens by kind (training, sampling_prefill, sampling_sample) in this UTC hour's bucket
        and, with `model_id`, in that run's totals: one write for all of it (`soon`: journaled, committed
        with the pass that did the work)."""
        hour = int(time.time()) // 3600 * 3600
        statements = []
        for kind, tokens in counts.items():
            statements.append(
                (
                    "INSERT INTO usage (tenant, hour, session_id, base_model, kind, tokens) VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(tenant, hour, session_id, base_model, kind) DO UPDATE SET tokens = tokens + ?",
                    (tenant, hour, session_id or "", base_model, kind, int(tokens), int(tokens)),
                )
            )
            if model_id is not None:
                statements.append(
                    (
                        "INSERT INTO run_usage (model_id, tenant, kind, tokens) VALUES (?, ?, ?, ?) "
                        "ON CONFLICT(model_id, kind) DO UPDATE SET tokens = tokens + ?",
                        (model_id, tenant, kind, int(tokens), int(tokens)),
                    )
                )
        if soon:
            self.db.soon(statements)
        else:
            self.db.execute_all(statements)

    def since(self, tenant: str, start: float) -> int:
        """Tokens of every kind the tenant used in the hours from `start` on."""
        self.db.flush()  # journaled counts (the passes') are part of every report
        return self.db.one(
            "SELECT COALESCE(SUM(tokens), 0) AS n FROM usage WHERE tenant=? AND hour >= ?", (tenant, start)
        )["n"]

    def totals(self, tenant: str) -> dict[str, int]:
        """All-time tokens of the tenant by kind."""
        self.db.flush()  # journaled counts (the passes') are part of every report
        return {
            r["kind"]: r["tokens"]
            for r in self.db.all(
                "SELECT kind, SUM(tokens) AS tokens FROM usage WHERE tenant=? GROUP BY kind", (tenant,)
            )
        }

    def of_runs(self, tenant: str) -> list[dict]:
        """Per run of the tenant: tokens by kind and checkpoint bytes stored, runs with either."""
        self.db.flush()  # journaled counts (the passes') are part of every report
        return self.db.all(
            "SELECT m.model_id, m.api, m.created_at, "
            "(SELECT COALESCE(SUM(tokens), 0) FROM run_usage u WHERE u.model_id = m.model_id AND u.kind = 'training') "
            " AS training, "
            "(SELECT COALESCE(SUM(tokens), 0) FROM run_usage u WHERE u.model_id = m.model_id AND u.kind != 'training') "
            " AS sampling, "
            "(SELECT COALESCE(SUM(size_bytes), 0) FROM checkpoints c WHERE c.model_id = m.model_id) AS checkpoint_bytes "
            "FROM models m WHERE m.tenant=? ORDER BY m.created_at",
            (tenant,),
        )

    def buckets(self, tenant: str, start: float, end: float) -> list[dict]:
        self.db.flush()  # journaled counts (the passes') are part of every report
        return self.db.all(
            "SELECT hour, session_id, base_model, kind, tokens FROM usage WHERE tenant=? AND hour >= ? "
            "AND hour < ? ORDER BY hour, tokens DESC",
            (tenant, start, end),
        )

    def of_session(self, session_id: str) -> list[dict]:
        self.db.flush()  # journaled counts (the passes') are part of every report
        return self.db.all("SELECT hour, kind, tokens FROM usage WHERE session_id=? ORDER BY hour", (session_id,))


class Projects:
    """Session projects (a label, `default` until set) and the per-session views search and billing need."""

    def __init__(self, db):
        self.db = db

    def set(self, session_id: str, project_id: str) -> None:
        put_row(self.db, "session_projects", {"session_id": session_id, "project_id": project_id})

    def of(self, session_id: str) -> str:
        row = self.db.one("SELECT project_id FROM session_projects WHERE session_id=?", (session_id,))
        return row["project_id"] if row else "default"

    def sessions_with_details(self, tenant: str) -> list[dict]:
        """Every session of `tenant`, newest first, with its project and checkpoint count and bytes."""
        return self.db.all(
            "SELECT s.*, COALESCE(p.project_id, 'default') AS project_id, "
            "(SELECT COUNT(*) FROM checkpoints c JOIN models m ON m.model_id = c.model_id "
            " WHERE m.session_id = s.session_id) AS checkpoints_count, "
            "(SELECT COALESCE(SUM(c.size_bytes), 0) FROM checkpoints c JOIN models m "
            " ON m.model_id = c.model_id WHERE m.session_id = s.session_id) AS checkpoint_bytes "
            "FROM sessions s LEFT JOIN session_projects p ON p.session_id = s.session_id "
            "WHERE s.tenant=? ORDER BY s.created_at DESC, s.session_id DESC",
            (tenant,),
        )

    def checkpoint_storage(self, tenant: str, project_id: str | None) -> dict:
        """Live checkpoints of `tenant` (of one project's sessions, if given): count and bytes."""
        sql = (
            "SELECT COUNT(*) AS n, COALESCE(SUM(c.size_bytes), 0) AS size FROM checkpoints c "
            "LEFT JOIN models m ON m.model_id = c.model_id LEFT JOIN session_projects p ON p.session_id = m.session_id "
            "WHERE c.tenant=? AND (c.expires_at IS NULL OR c.expires_at > ?)"
        )
        args = [tenant, time.time()]
        if project_id is not None:
            sql += " AND COALESCE(p.project_id, 'default') = ?"
            args.append(project_id)
        return self.db.one(sql, tuple(args))


class Quotas:
    """Per-key limits; a missing row or a NULL field means no limit."""

    FIELDS = ("tokens_per_day", "storage_bytes", "adapters")

    def __init__(self, db):
        self.db = db

    def get(self, tenant: str) -> dict:
        row = self.db.one("SELECT tokens_per_day, storage_bytes, adapters FROM quotas WHERE tenant=?", (tenant,))
        return row or dict.fromkeys(self.FIELDS)

    def set(self, tenant: str, **values) -> dict:
        """Change the given fields (None clears one); the others keep their value."""
        merged = {**self.get(tenant), **values}
        put_row(self.db, "quotas", {"tenant": tenant, **{k: merged[k] for k in self.FIELDS}})
        return merged

    def bytes_stored(self, tenant: str) -> int:
        return self.db.one("SELECT COALESCE(SUM(size_bytes), 0) AS n FROM checkpoints WHERE tenant=?", (tenant,))["n"]


class RunSamples:
    """The last few sampled completions a run's owner posted for its run page; older ones are dropped."""

    KEEP = 20  # per run: a glance at recent outputs, not a dataset

    def __init__(self, db):
        self.db = db

    def add(self, model_id: str, tenant: str, samples: list[dict]) -> int:
        now = time.time()
        for i, s in enumerate(samples):  # i: the order within one post survives equal timestamps
            self.db.execute(
                "INSERT INTO run_samples (model_id, tenant, t, step, prompt, completion, reward) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (model_id, tenant, now + i * 1e-6, s.get("step"), s["prompt"], s["completion"], s.get("reward")),
            )
        self.db.execute(
            "DELETE FROM run_samples WHERE model_id=? AND t NOT IN "
            "(SELECT t FROM run_samples WHERE model_id=? ORDER BY t DESC LIMIT ?)",
            (model_id, model_id, self.KEEP),
        )
        return self.count(model_id)

    def of(self, model_id: str, tenant: str, limit: int = KEEP) -> list[dict]:
        """Newest first; the tenant is part of the lookup so no other tenant's sample can come back."""
        return self.db.all(
            "SELECT t, step, prompt, completion, reward FROM run_samples WHERE model_id=? AND tenant=? "
            "ORDER BY t DESC LIMIT ?",
            (model_id, tenant, limit),
        )

    def count(self, model_id: str) -> int:
        return self.db.one("SELECT COUNT(*) AS n FROM run_samples WHERE model_id=?", (model_id,))["n"]
