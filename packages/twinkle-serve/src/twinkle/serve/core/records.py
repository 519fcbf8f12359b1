"""The service's objects as typed records, read from the store (one row each) and shared by both APIs.

A training run is one `Run` whichever API created it (`api` says which); a checkpoint is one
`Checkpoint` folder under the data dir; a future is one `FutureRow`. Routes translate these to
their wire formats; nothing outside the store reads a raw row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Literal

Api = Literal["tinker", "native"]
Kind = Literal["training", "sampler", "external"]
# the path segment of each checkpoint kind; `external` is a PEFT folder exported for download
SEGMENT: dict[Kind, str] = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
KIND: dict[str, Kind] = {v: k for k, v in SEGMENT.items()}


def _json(text, default):
    return json.loads(text) if text else default


@dataclass(frozen=True)
class Session:
    session_id: str
    tenant: str
    created_at: float
    last_heartbeat: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    tags: list = field(default_factory=list)
    user_metadata: dict = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: dict) -> Session:
        return cls(**{**row, "tags": _json(row["tags"], []), "user_metadata": _json(row["user_metadata"], {})})


@dataclass(frozen=True)
class Run:
    """A training run (the Tinker `model_id` `{session}:train:{n}`): one base model, its LoRA(s)."""

    model_id: str
    tenant: str
    session_id: str
    base_model: str
    api: Api
    lora: dict  # tinker: rank/seed/train_*; native: rank/seed/name/adapters
    created_at: float
    last_request_time: float | None = None
    user_metadata: dict = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: dict) -> Run:
        return cls(**{**row, "lora": _json(row["lora"], {}), "user_metadata": _json(row["user_metadata"], {})})

    @property
    def name(self) -> str | None:
        return self.lora.get("name")


@dataclass(frozen=True)
class SamplingSession:
    """A sampler a tenant samples from (a row of `samplers`): a checkpoint's weights (`model_path`),
    the base model's (neither), or an ephemeral snapshot of a training run's."""

    sampler_id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    created_at: float
    ephemeral: bool = False

    @classmethod
    def from_row(cls, row: dict) -> SamplingSession:
        return replace(cls(**row), ephemeral=bool(row["ephemeral"]))  # SQLite stores booleans as 0/1


@dataclass(frozen=True)
class Checkpoint:
    tinker_path: str
    tenant: str
    model_id: str
    kind: Kind
    name: str
    created_at: float
    size_bytes: int
    public: bool
    expires_at: float | None
    dir: str  # relative to the data dir
    user_metadata: dict = field(default_factory=dict)

    @classmethod
    def from_row(cls, row: dict) -> Checkpoint:
        return replace(cls(**row), public=bool(row["public"]), user_metadata=_json(row["user_metadata"], {}))

    @property
    def checkpoint_id(self) -> str:
        return f"{SEGMENT[self.kind]}/{self.name}"

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at < now


@dataclass(frozen=True)
class FutureRow:
    request_id: str
    status: Literal["pending", "complete", "failed"]
    content_type: str | None = None
    payload: bytes | None = None


@dataclass(frozen=True)
class LiveAdapter:
    """An adapter alive in this process: which base model's backend holds it, under which engine name."""

    base_model: str
    adapter: str
