"""The operator page's numbers (`GET /twinkle/v1/operator/summary`), for operator keys only.

Read from the same objects `/metrics` reads (the schedulers, the adapter memory manager, the
request counter of `twinkle.serve.prometheus`), at request time: the hot path keeps no extra books.
Unlike `/metrics` it names tenants and runs, so it needs a key made with
`twinkle-server keys create NAME --operator`; a tenant key gets 403.
"""

from __future__ import annotations

import time
from collections import defaultdict

from fastapi import Security

from twinkle.serve.auth import API_KEY
from twinkle.serve.errors import Forbidden, Unauthorized

WINDOW_S = 60.0  # passes/s and rows per pass over the last minute


def operator_dependency(rt):
    async def operator(key: str | None = Security(API_KEY)) -> str:
        tenant = rt.keys.tenant_for(key)
        if tenant is None:
            raise Unauthorized("missing or invalid API key (header X-API-Key)")
        if not rt.keys.is_operator(key):
            raise Forbidden(
                f"key {tenant!r} is a tenant key; the operator page needs an operator key "
                "(`twinkle-server keys create NAME --operator`)"
            )
        return tenant

    return operator


def rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc); None where that is not readable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _passes(schedulers) -> dict:
    cutoff = time.monotonic() - WINDOW_S
    recent = [p for s in schedulers for p in list(s.recent_passes) if p[0] >= cutoff]
    fused = [p for p in recent if p[1] > 1]
    with_rows = [p[2] for p in recent if p[2]]
    return {
        "passes_per_s": len(recent) / WINDOW_S,
        "fused_passes_per_s": len(fused) / WINDOW_S,
        "requests_per_pass": sum(p[1] for p in recent) / len(recent) if recent else None,
        "rows_per_pass": sum(with_rows) / len(with_rows) if with_rows else None,
        "fused_passes_total": sum(s.fused_passes for s in schedulers),
    }


def _routes(metrics) -> list[dict]:
    """Requests per route template and status class, from the counter `/metrics` exports."""
    table: dict[tuple[str, str], dict] = defaultdict(lambda: {"2xx": 0, "3xx": 0, "4xx": 0, "5xx": 0})
    for family in metrics.requests.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = (sample.labels["method"], sample.labels["route"])
                table[key][sample.labels["status"]] = table[key].get(sample.labels["status"], 0) + int(sample.value)
    rows = [{"method": m, "route": r, **c, "total": sum(c.values())} for (m, r), c in table.items()]
    return sorted(rows, key=lambda row: -row["total"])


def _live_runs(rt) -> list[dict]:
    now, out = time.time(), []
    for model_id in rt.live.run_ids():
        run = rt.store.runs.get(model_id)
        if run is None:
            continue
        out.append(
            {
                "tenant": run.tenant,
                "model_id": model_id,
                "name": run.name,
                "api": run.api,
                "base_model": run.base_model,
                "steps": rt.store.curves.count(model_id, "loss"),
                "idle_s": max(now - (run.last_request_time or run.created_at), 0.0),
            }
        )
    return sorted(out, key=lambda r: r["idle_s"])


def snapshot(rt) -> dict:
    engines = rt.engines
    oldest = rt.store.futures.oldest_pending()
    runs = _live_runs(rt)
    pending = rt.store.futures.pending("")[0]
    return {
        "ready": rt.ready.is_set(),
        "tenants": sorted({r["tenant"] for r in runs}),
        "runs": runs,
        "queue": {
            "depth": {name: e.scheduler.depth() for name, e in engines.items()},
            "pending_futures": pending,
            "oldest_waiting_s": None if oldest is None else max(time.time() - oldest, 0.0),
        },
        "passes": _passes([e.scheduler for e in engines.values()]),
        "tokens_per_s": rt.throughput.tokens_per_s(),
        "adapters": rt.adapter_memory.report(),
        "rss_bytes": rss_bytes(),
        "routes": _routes(rt.metrics),
        # each base model's frozen weights: bf16 halves what they hold where the hardware multiplies it fast
        "base_dtypes": {name: e.backend.base_dtype() for name, e in engines.items()},
    }
