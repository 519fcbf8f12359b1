"""The dashboard: one static page (`GET /dashboard`) and the JSON route it polls.

The page holds no data of its own: it asks for an API key (kept in the browser's localStorage, or
`/dashboard#key=tml-...`) and polls `GET /twinkle/v1/dashboard/summary` with it, so a viewer sees
only their own tenant's runs, with live loss and reward curves, the key's usage (tokens trained and
sampled, checkpoint bytes, per run too) against its quotas, plus the server's queue depth and throughput.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from twinkle.client.schema import PREFIX, CurvePoint, RunSummary, ServerStatus
from twinkle.serve.auth import Auth
from twinkle.serve.core.usage import UsageLedger
from twinkle.serve.native.views import NativeViews

CURVES = ("loss", "reward")


class DashboardRun(RunSummary):
    curves: dict[str, list[CurvePoint]]
    usage: dict[str, int]  # training and sampling tokens, checkpoint bytes of this run


class DashboardSummary(BaseModel):
    tenant: str
    status: ServerStatus | None
    runs: list[DashboardRun]
    usage: dict  # twinkle.serve.core.usage.UsageLedger.report: the key's totals, today's tokens, quotas


def build_dashboard_router(views: NativeViews) -> APIRouter:
    """Runs of both APIs (a Tinker run's forward_backward losses are on its curves as a native run's are)."""
    rt = views.rt
    tenant = Auth(rt).unmetered
    page = resources.files(__name__).joinpath("index.html").read_text()
    ledger = UsageLedger(rt.store)
    r = APIRouter(tags=["dashboard"])

    @r.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    def dashboard():
        return page

    @r.get(
        f"{PREFIX}/dashboard/summary",
        response_model=DashboardSummary,
        summary="The caller's runs with their loss/reward curves, and the server's queue and throughput",
    )
    def summary(limit: int = Query(20, ge=1, le=10_000), t: str = Depends(tenant)):  # SQLite ints are 64-bit
        runs, usage = [], ledger.report(t)
        per_run = {r["model_id"]: r for r in usage["runs"]}
        zero = {"training": 0, "sampling": 0, "checkpoint_bytes": 0}
        for run in views.runs(t, limit).runs:
            curves = rt.store.curves.of(run.model_id)
            counted = per_run.get(run.model_id, zero)
            runs.append(
                DashboardRun(
                    **run.model_dump(),
                    curves={k: curves.get(k, []) for k in CURVES},
                    usage={k: counted[k] for k in zero},
                )
            )
        status = views.status(t) if rt.ready.is_set() else None
        return DashboardSummary(tenant=t, status=status, runs=runs, usage=usage)

    return r
