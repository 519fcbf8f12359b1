"""stable_reinforce's tables: the recorded sampled sequences and the policy version each sampler serves.

A record is written when a sample made with `record_stability_info` finishes and read back when a
`forward_backward(loss_fn="stable_reinforce")` names it; it lives in the store (not in memory), so a
restart on the same data dir keeps it, and per tenant the store holds at most a configured number of
recorded tokens (the least recently used records are dropped first).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StabilityRecord:
    sequence_id: str
    tenant: str
    session_id: str
    sampler_id: str | None
    model_id: str | None  # the training run whose weights sampled it (None: the base model)
    policy_version: int  # that run's optimizer steps when its weights were taken
    prompt: np.ndarray  # int32, the request's prompt
    tokens: np.ndarray  # int32, the sampled tokens
    logprobs: np.ndarray  # float32, the sampler's log-prob of each sampled token
    created_at: float
    last_used: float

    @classmethod
    def from_row(cls, row: dict) -> StabilityRecord:
        row = dict(row)
        row.pop("n_tokens", None)
        for name, dtype in (("prompt", np.int32), ("tokens", np.int32), ("logprobs", np.float32)):
            row[name] = np.frombuffer(row[name], dtype=dtype)
        return cls(**row)


class StabilityRecords:
    def __init__(self, db):
        self.db = db

    def put(self, rec: StabilityRecord) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO stability_records (sequence_id, tenant, session_id, sampler_id, model_id, "
            "policy_version, prompt, tokens, logprobs, n_tokens, created_at, last_used) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                rec.sequence_id,
                rec.tenant,
                rec.session_id,
                rec.sampler_id,
                rec.model_id,
                rec.policy_version,
                np.ascontiguousarray(rec.prompt, dtype=np.int32).tobytes(),
                np.ascontiguousarray(rec.tokens, dtype=np.int32).tobytes(),
                np.ascontiguousarray(rec.logprobs, dtype=np.float32).tobytes(),
                len(rec.prompt) + len(rec.tokens),
                rec.created_at,
                rec.last_used,
            ),
        )

    def owned(self, sequence_ids: list[str], tenant: str) -> dict[str, StabilityRecord]:
        """The tenant's records among these ids (another tenant's are simply absent)."""
        out: dict[str, StabilityRecord] = {}
        ids = sorted(set(sequence_ids))
        for i in range(0, len(ids), 500):  # SQLite's bound-parameter limit
            chunk = ids[i : i + 500]
            marks = ", ".join("?" for _ in chunk)
            for row in self.db.all(
                f"SELECT * FROM stability_records WHERE tenant=? AND sequence_id IN ({marks})", (tenant, *chunk)
            ):
                out[row["sequence_id"]] = StabilityRecord.from_row(row)
        return out

    def touch(self, sequence_ids: list[str], now: float) -> None:
        for sid in set(sequence_ids):
            self.db.execute("UPDATE stability_records SET last_used=? WHERE sequence_id=?", (now, sid))

    def prune(self, tenant: str, expired_before: float, max_tokens: int) -> int:
        """Drop records unused since `expired_before` (every tenant's), then the tenant's least recently
        used ones until it holds at most `max_tokens` recorded tokens. -> rows dropped."""
        dropped = self.db.execute("DELETE FROM stability_records WHERE last_used < ?", (expired_before,))
        total = (self.db.one("SELECT SUM(n_tokens) AS n FROM stability_records WHERE tenant=?", (tenant,)) or {})["n"]
        excess = (total or 0) - max_tokens
        if excess > 0:
            victims, freed = [], 0
            for row in self.db.all(
                "SELECT sequence_id, n_tokens FROM stability_records WHERE tenant=? ORDER BY last_used, created_at",
                (tenant,),
            ):
                if freed >= excess:
                    break
                victims.append(row["sequence_id"])
                freed += row["n_tokens"]
            for sid in victims:
                dropped += self.db.execute("DELETE FROM stability_records WHERE sequence_id=?", (sid,))
        return dropped

    def drop_session(self, session_id: str) -> int:
        return self.db.execute("DELETE FROM stability_records WHERE session_id=?", (session_id,))

    def count(self, tenant: str) -> tuple[int, int]:
        """-> (records, recorded tokens) the tenant holds."""
        row = self.db.one(
            "SELECT COUNT(*) AS n, COALESCE(SUM(n_tokens), 0) AS t FROM stability_records WHERE tenant=?", (tenant,)
        )
        return row["n"], row["t"]

    # ---- the policy each sampler serves ----
    def set_policy(self, sampler_id: str, model_id: str | None, version: int) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO stability_policies (sampler_id, model_id, policy_version) VALUES (?, ?, ?)",
            (sampler_id, model_id, version),
        )

    def policy(self, sampler_id: str) -> tuple[str | None, int] | None:
        row = self.db.one("SELECT model_id, policy_version FROM stability_policies WHERE sampler_id=?", (sampler_id,))
        return (row["model_id"], row["policy_version"]) if row else None
