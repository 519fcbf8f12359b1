"""A run page's numbers: the charts' series derived from the run's stored curves, its checkpoints,
and the samples its owner posted.

What the server stores per training step (`run_curves`): `loss` (Tinker: `loss:sum`; native: the
adapter loss's value, a per-token mean unless configured otherwise), `loss_tokens` (Tinker: what
`loss:sum` sums over, cross_entropy's weights), `tokens` (the pass's input tokens), and after each
optimizer step `lr` and `grad_norm`; plus whatever the client logged (`reward`, `accuracy`, ...).
Derived here, never stored: per-token loss, and step time / tokens/s from the points' timestamps
(wall clock between consecutive training steps, so time the client spent between steps counts).
"""

from __future__ import annotations

import itertools
import time
from urllib.parse import quote

from pydantic import BaseModel, Field

from twinkle.client.schema import CurvePoint

# Stored curve names that are inputs to a derived series, not charts of their own.
INTERNAL = {"loss", "loss_tokens", "tokens", "lr", "grad_norm", "tokens_per_s", "mfu"}
MAX_TEXT = 4000  # characters per prompt or completion: a glance, not a dataset
MAX_POST = 20  # samples per post (the store keeps the newest RunSamples.KEEP per run)


class SampleIn(BaseModel):
    prompt: str = Field(max_length=MAX_TEXT)
    completion: str = Field(max_length=MAX_TEXT)
    reward: float | None = Field(None, allow_inf_nan=False)  # JSON has no inf/NaN to show it back with
    step: int | None = Field(None, ge=0, le=2**62)  # SQLite integers are 64-bit


class SamplesIn(BaseModel):
    samples: list[SampleIn] = Field(min_length=1, max_length=MAX_POST)


class SampleOut(SampleIn):
    t: float


class CheckpointRow(BaseModel):
    path: str  # the copy-paste tinker:// path
    kind: str  # training (optimizer state too) / sampler (weights only) / external
    name: str
    size_bytes: int
    created_at: float
    expires_at: float | None  # None: kept until deleted
    ttl_s: float | None
    public: bool
    download: str | None  # the zip route (same X-API-Key as the API); None for folders that are not PEFT


class RunPage(BaseModel):
    model_id: str
    name: str | None
    api: str
    base_model: str
    series: dict[str, list[CurvePoint]]
    mfu: str | None  # why MFU shows "n/a" when it does
    checkpoints: list[CheckpointRow]
    samples: list[SampleOut]


def _by_step(points: list[dict]) -> dict[int, dict]:
    """One point per step (a native run with several adapters has several): values summed, latest time."""
    out: dict[int, dict] = {}
    for p in points:
        if p["step"] is None:
            continue
        seen = out.setdefault(p["step"], {"step": p["step"], "value": 0.0, "t": p["t"]})
        seen["value"] += p["value"]
        seen["t"] = max(seen["t"], p["t"])
    return out


def derive(curves: dict[str, list[dict]], api: str) -> tuple[dict[str, list[dict]], str | None]:
    """The chart series of a run (only those it has points for), and the reason MFU is n/a if it is."""
    loss, counted = _by_step(curves.get("loss", [])), _by_step(curves.get("loss_tokens", []))
    per_token = []
    for step, p in sorted(loss.items()):
        n = counted.get(step, {}).get("value")
        if api == "tinker":  # loss:sum means nothing per token without its count: such a point is left out
            if n:
                per_token.append({**p, "value": p["value"] / n})
        else:
            per_token.append(p)
    series = {"loss_per_token": per_token}
    tokens = _by_step(curves.get("tokens", []))
    step_time, tokens_per_s = [], []
    steps = sorted(loss)
    for prev, step in itertools.pairwise(steps):
        dt = loss[step]["t"] - loss[prev]["t"]
        if dt > 0:
            step_time.append({"step": step, "value": dt, "t": loss[step]["t"]})
            if step in tokens:
                tokens_per_s.append({"step": step, "value": tokens[step]["value"] / dt, "t": loss[step]["t"]})
    series["tokens_per_s"] = curves.get("tokens_per_s") or tokens_per_s  # a logged number wins over the estimate
    series["step_time_s"] = step_time
    for name in ("lr", "grad_norm"):
        series[name] = curves.get(name, [])
    mfu = [p for p in curves.get("mfu", []) if p["value"] > 0]
    reason = None
    if mfu:
        series["mfu"] = mfu
    else:  # no FLOPs recorded (a Ray-sharded pass): a 0 would read as "idle", which it is not
        reason = "n/a: this run's passes recorded no FLOPs"
    for name, points in curves.items():
        if name not in INTERNAL and points:  # reward, accuracy, ...: only runs that report them get a chart
            series[name] = points
    return {k: v for k, v in series.items() if v}, reason


def checkpoint_rows(checkpoints, archive_url: str) -> list[CheckpointRow]:
    """`archive_url`: the native zip route; a row's link adds its path (the page sends the key with it)."""
    now = time.time()
    return [
        CheckpointRow(
            path=c.tinker_path,
            kind=c.kind,
            name=c.name,
            size_bytes=c.size_bytes or 0,
            created_at=c.created_at,
            expires_at=c.expires_at,
            ttl_s=None if c.expires_at is None else max(c.expires_at - now, 0.0),
            public=c.public,
            download=None if c.kind == "external" else f"{archive_url}?path={quote(c.tinker_path, safe='')}",
        )
        for c in checkpoints
    ]
