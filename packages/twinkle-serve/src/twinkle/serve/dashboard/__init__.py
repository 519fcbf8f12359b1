"""The dashboard: static pages (`GET /dashboard`, `GET /operator`) and the JSON routes they poll.

The pages hold no data of their own and load nothing from outside this server (the chart code is
`chart.js` beside them): they ask for an API key (kept in the browser's localStorage, or
`/dashboard#key=tml-...`) and poll with it, so a viewer sees only their own tenant's runs:
per-run charts over steps (per-token loss, lr, grad norm, tokens/s, step time, MFU, and reward or
accuracy where the run logs them), several runs overlaid, the run's checkpoints with downloads, and
the samples its owner posted. `/operator` needs an operator key and shows every tenant's load.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel

from twinkle.client.schema import PREFIX, CurvePoint, RunSummary, ServerStatus
from twinkle.serve.auth import Auth
from twinkle.serve.core.usage import UsageLedger
from twinkle.serve.dashboard.operator import operator_dependency, snapshot
from twinkle.serve.dashboard.runs import RunPage, SampleOut, SamplesIn, checkpoint_rows, derive
from twinkle.serve.errors import NotFound
from twinkle.serve.native.views import NativeViews

CURVES = ("loss", "reward")
ASSETS = {"chart.js": "text/javascript", "style.css": "text/css"}


class DashboardRun(RunSummary):
    curves: dict[str, list[CurvePoint]]  # the stored loss and reward points (Tinker: loss:sum)
    loss_per_token: float | None  # the last step's, as the run page charts it
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
    operator = operator_dependency(rt)
    files = resources.files(__name__)
    pages = {name: files.joinpath(f"{name}.html").read_text() for name in ("index", "operator")}
    assets = {name: files.joinpath(name).read_text() for name in ASSETS}
    ledger = UsageLedger(rt.store)
    r = APIRouter(tags=["dashboard"])

    def owned(t: str, model_id: str):
        run = rt.store.runs.owned(model_id, t)
        if run is None:  # another tenant's run reads as absent, as everywhere in the API
            raise NotFound(f"run {model_id!r} not found")
        return run

    @r.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    def dashboard():
        return pages["index"]

    @r.get("/operator", response_class=HTMLResponse, include_in_schema=False)
    def operator_page():
        return pages["operator"]

    @r.get("/dashboard/{name}", include_in_schema=False)
    def asset(name: str):
        if name not in ASSETS:
            raise NotFound(f"no dashboard file {name!r}")
        return Response(assets[name], media_type=ASSETS[name], headers={"Cache-Control": "max-age=300"})

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
            per_token = derive(curves, run.api)[0].get("loss_per_token")
            counted = per_run.get(run.model_id, zero)
            runs.append(
                DashboardRun(
                    **run.model_dump(),
                    curves={k: curves.get(k, []) for k in CURVES},
                    loss_per_token=per_token[-1]["value"] if per_token else None,
                    usage={k: counted[k] for k in zero},
                )
            )
        status = views.status(t) if rt.ready.is_set() else None
        return DashboardSummary(tenant=t, status=status, runs=runs, usage=usage)

    @r.get(
        f"{PREFIX}/dashboard/runs/{{model_id}}",
        response_model=RunPage,
        summary="One run's chart series over steps, its checkpoints and its posted samples",
    )
    def run_page(model_id: str, t: str = Depends(tenant)):
        run = owned(t, model_id)
        series, mfu = derive(rt.store.curves.of(model_id), run.api)
        return RunPage(
            model_id=model_id,
            name=run.name,
            api=run.api,
            base_model=run.base_model,
            series=series,
            mfu=mfu,
            checkpoints=checkpoint_rows(views.svc.checkpoints.of_run(t, model_id), f"{PREFIX}/checkpoints/archive"),
            samples=rt.store.run_samples.of(model_id, t),
        )

    @r.post(
        f"{PREFIX}/dashboard/runs/{{model_id}}/samples",
        summary="Show these sampled completions on the run's page (opt-in; the newest 20 are kept)",
    )
    def post_samples(model_id: str, body: SamplesIn, t: str = Depends(tenant)) -> dict:
        owned(t, model_id)
        kept = rt.store.run_samples.add(model_id, t, [s.model_dump() for s in body.samples])
        return {"model_id": model_id, "added": len(body.samples), "kept": kept}

    @r.get(f"{PREFIX}/dashboard/runs/{{model_id}}/samples", response_model=list[SampleOut])
    def get_samples(model_id: str, t: str = Depends(tenant)):
        owned(t, model_id)
        return rt.store.run_samples.of(model_id, t)

    @r.get(f"{PREFIX}/operator/summary", summary="Every tenant's load, queue, passes, adapters, memory, requests")
    def operator_summary(_: str = Depends(operator)) -> dict:
        return snapshot(rt)

    return r
