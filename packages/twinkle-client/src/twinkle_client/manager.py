"""`init_twinkle_client` / `init_tinker_client` and the client they return, with twinkle-kit's env names.

twinkle-kit reads TWINKLE_SERVER_URL / TWINKLE_SERVER_TOKEN; ours TWINKLE_BASE_URL / TWINKLE_API_KEY:
either pair works. The client is ours (`twinkle.client.TwinkleClient`) plus twinkle-kit's listings.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime

from twinkle.client import http, session
from twinkle.client.schema import CheckpointList, RunList, ServerStatus
from twinkle_client.types import Checkpoint, ServerCapabilities, SupportedModel, TrainingRun


def _time(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=UTC)


class TwinkleClient(http.TwinkleClient):
    def get_server_capabilities(self) -> ServerCapabilities:
        status = ServerStatus.model_validate(self.get("/server"))
        return ServerCapabilities(supported_models=[SupportedModel(model_name=m.name) for m in status.base_models])

    def list_training_runs(self, limit: int = 20, offset: int = 0) -> list[TrainingRun]:
        runs = RunList.model_validate(self.get("/runs", limit=limit + offset)).runs[offset:]
        return [
            TrainingRun(
                training_run_id=r.model_id,
                base_model=r.base_model,
                name=r.name,
                api=r.api,
                lora_rank=r.lora_rank,
                steps=r.steps,
                last_loss=r.last_loss,
                last_request_time=_time(r.last_request_time),
            )
            for r in runs
        ]

    def list_checkpoints(self, run_id: str) -> list[Checkpoint]:
        found = CheckpointList.model_validate(self.get("/checkpoints", model_id=run_id)).checkpoints
        return [
            Checkpoint(
                checkpoint_id=c.name,
                checkpoint_type=c.kind,
                time=datetime.fromtimestamp(c.created_at, tz=UTC),
                size_bytes=c.size_bytes,
                twinkle_path=c.path,
                training_run_id=c.model_id,
            )
            for c in found
        ]

    def get_latest_checkpoint_path(self, run_id: str) -> str | None:
        """The newest training checkpoint's path (tinker://...), which resume_from_checkpoint takes;
        None when the run saved none. (twinkle-kit returns the server's folder; ours stays on the server.)"""
        training = [c for c in self.list_checkpoints(run_id) if c.checkpoint_type == "training"]
        return max(training, key=lambda c: c.time).twinkle_path if training else None


def init_twinkle_client(
    base_url: str | None = None,
    api_key: str | None = None,
    session_heartbeat_interval: int = 10,
    *,
    timeout: float = 60.0,
    max_retries: int = 30,
) -> TwinkleClient:
    """Connect this process to a Twinkle server; every proxy made afterwards uses this client.
    `session_heartbeat_interval` is accepted for twinkle-kit's scripts: our server keeps a tenant's
    models without a heartbeat, so there is nothing to send."""
    if not isinstance(session_heartbeat_interval, int) or session_heartbeat_interval < 1:
        raise ValueError(f"session_heartbeat_interval must be a positive int, got {session_heartbeat_interval!r}")
    client = TwinkleClient(
        base_url or os.environ.get("TWINKLE_SERVER_URL"),
        api_key or os.environ.get("TWINKLE_SERVER_TOKEN"),
        timeout=timeout,
        max_retries=max_retries,
    )
    session.set_client(client)
    return client


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """Point the unmodified Tinker SDK at a Twinkle server: TINKER_BASE_URL / TINKER_API_KEY from the
    arguments or TWINKLE_SERVER_URL / TWINKLE_SERVER_TOKEN (or ours). Nothing is patched: with neither,
    the SDK's own settings (or the arguments a script gives ServiceClient) are used as they are."""
    return session.init_tinker_client(
        base_url or os.environ.get("TWINKLE_SERVER_URL"), api_key or os.environ.get("TWINKLE_SERVER_TOKEN")
    )
