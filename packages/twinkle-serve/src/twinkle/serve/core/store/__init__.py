"""The server's durable state: one SQLite file in the data dir, and every SQL statement the server runs.

Sessions, training runs, samplers, checkpoint metadata, futures, API keys, the answers to idempotent
submissions, the runs' curves, token usage, per-key quotas, the samples a run shows on the dashboard and the audit log. Checkpoint *files* live beside it under `tenants/<tenant>/...`;
this file says which exist. Everything a client was told (a future's result, a checkpoint path) is
committed here before the client can see it, so a restart on the same data dir loses nothing that
was acknowledged. The bookkeeping rows of a step are journaled and committed together (`db.py`).
The schema is versioned (`schema.py`); opening an older database upgrades it.
"""

from __future__ import annotations

import os
from pathlib import Path

from twinkle.serve.core.store.account_tables import (
    CustomLosses,
    Projects,
    Quotas,
    RunSamples,
    SampleRequests,
    Usage,
)
from twinkle.serve.core.store.audit_tables import AuditEvents
from twinkle.serve.core.store.db import Db
from twinkle.serve.core.store.objects import Checkpoints, Runs, Samplers, Sessions
from twinkle.serve.core.store.schema import VERSION
from twinkle.serve.core.store.service_tables import Curves, Futures, Idempotency, Keys
from twinkle.serve.core.store.stability_tables import StabilityRecords

__all__ = ["VERSION", "Db", "Store", "default_data_dir"]


def default_data_dir() -> Path:
    """Where the server keeps its store and checkpoints unless told otherwise."""
    return Path(os.environ.get("TWINKLE_DATA_DIR", Path.home() / ".local" / "share" / "twinkle-server"))


class Store:
    def __init__(self, data_dir: str | Path):
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.db = Db(self.data_dir / "twinkle.db")
        self.keys, self.sessions, self.runs = Keys(self.db), Sessions(self.db), Runs(self.db)
        self.samplers, self.checkpoints = Samplers(self.db), Checkpoints(self.db)
        self.futures, self.idempotency, self.curves = Futures(self.db), Idempotency(self.db), Curves(self.db)
        self.custom_losses, self.sample_requests = CustomLosses(self.db), SampleRequests(self.db)
        self.projects, self.usage, self.quotas = Projects(self.db), Usage(self.db), Quotas(self.db)
        self.run_samples = RunSamples(self.db)
        self.stability = StabilityRecords(self.db)  # stable_reinforce's sampled-sequence records
        self.audit = AuditEvents(self.db)

    @property
    def version(self) -> int:
        return self.db.version

    def close(self) -> None:
        self.db.close()
