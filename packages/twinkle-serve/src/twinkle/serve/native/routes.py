"""The native Twinkle HTTP API under /twinkle/v1: typed bodies (twinkle.client.schema), futures-first.

Auth, tenant scoping, rate limits, the store, futures and the scheduler are the server's own (the
same ones the Tinker routes use). Submitting routes answer `FutureRef`; the optional `X-Twinkle-Seq`
header orders a model's requests as the client issued them (pipelined clients send several at once).
"""

import json
from collections.abc import Callable
from typing import Any

from fastapi import Depends, Header, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from twinkle.client.schema import (
    PREFIX,
    AddAdapterRequest,
    AddMetricRequest,
    CheckpointList,
    CheckpointRef,
    CreateModelRequest,
    ForwardRequest,
    FutureRef,
    FutureResult,
    ImportAdapterRequest,
    LoadRequest,
    LogRequest,
    MetricRequest,
    ModelInfo,
    NamedComponent,
    ResultTypes,
    RunCurves,
    RunList,
    SampleRequest,
    SaveRequest,
    ServerStatus,
    StepRequest,
)
from twinkle.serve.auth import Auth
from twinkle.serve.core.adapter_import import AdapterImports
from twinkle.serve.core.service import Service
from twinkle.serve.errors import NotFound
from twinkle.serve.native.capacity import add_capacity_route
from twinkle.serve.native.checkpoints import NativeCheckpoints
from twinkle.serve.native.compute import NativeCompute
from twinkle.serve.native.models import NativeModels
from twinkle.serve.native.views import NativeViews
from twinkle.serve.queueing import queue_work
from twinkle.serve.routing import PrefixRouter


def build_native_router(core: Service) -> tuple[PrefixRouter, NativeViews]:
    """The native API's router, and its views (the dashboard reads the same runs and status)."""
    rt, auth = core.rt, Auth(core.rt)
    models = NativeModels(core)
    compute = NativeCompute(models)
    saving, views = NativeCheckpoints(models), NativeViews(compute)
    # submissions are metered; reads and polling (GET) are not
    tenant, ready = auth.unmetered, auth.ready

    r = PrefixRouter(PREFIX, tags=["twinkle"])
    seq_header = Header(None, alias="X-Twinkle-Seq", description="client order of this model's requests")
    # in this order: the OpenAPI document lists the routes as they are added
    _model_routes(r, models, ready, seq_header)
    _pass_routes(r, compute, ready, seq_header)
    _checkpoint_routes(r, core, saving, compute, auth, seq_header)
    _sample_and_future_routes(r, core, views, ready, tenant)
    _read_routes(r, views, tenant)
    add_capacity_route(r, rt, tenant)  # GET /capacity (twinkle.serve.native.capacity)
    return r, views


Dependency = Callable[..., Any]  # an Auth dependency: resolves to the caller's tenant


def _model_routes(r: PrefixRouter, models: NativeModels, ready: Dependency, seq_header: Any) -> None:
    """Create and close a model, add its adapter, set its loss, optimizer, scheduler and metrics."""

    @r.post("/models", response_model=ModelInfo, summary="Create a training model (a run) on a base model")
    def create_model(body: CreateModelRequest, t: str = Depends(ready)):
        return models.create_model(t, body)

    @r.delete("/models/{model_id}", response_model=FutureRef, summary="Free the model's adapters (result: closed)")
    def close_model(model_id: str, t: str = Depends(ready)):
        return models.close(t, model_id)

    @r.post(
        "/models/{model_id}/add_adapter_to_model",
        response_model=FutureRef,
        summary="Add a LoRA adapter (full peft LoraConfig); result {adapter_name, rank}",
    )
    def add_adapter(model_id: str, body: AddAdapterRequest, t: str = Depends(ready), seq: int | None = seq_header):
        return models.add_adapter(t, model_id, seq, body)

    def configure_route(what: str, model):
        def handler(model_id: str, body: model, t: str = Depends(ready), seq: int | None = seq_header):
            return models.configure(t, model_id, seq, what, body)

        handler.__name__ = f"set_{what}"
        path = "add_metric" if what == "metric" else f"set_{what}"
        r.add_api_route(
            f"/models/{{model_id}}/{path}",
            handler,
            methods=["POST"],
            response_model=FutureRef,
            summary=f"{path} by registered name with keyword arguments; result {{set, name}}",
        )

    configure_route("loss", NamedComponent)
    configure_route("optimizer", NamedComponent)
    configure_route("lr_scheduler", NamedComponent)
    configure_route("metric", AddMetricRequest)


def _pass_routes(r: PrefixRouter, compute: NativeCompute, ready: Dependency, seq_header: Any) -> None:
    """The passes and the step: forward_backward, forward_only, forward, clip_grad_and_step, calculate_metric."""

    async def submit_forward(request: Request, t: str, model_id: str, seq, body: ForwardRequest, backward: bool):
        # chats are templated (and their images decoded) here: never on the event loop
        light = body.inputs.trajectories is None
        return await queue_work(request, compute.forward, t, model_id, seq, body, backward, light=light)

    @r.post(
        "/models/{model_id}/forward_backward",
        response_model=FutureRef,
        summary="Forward, loss and backward (gradients accumulate); result ForwardResult",
    )
    async def forward_backward(
        request: Request, model_id: str, body: ForwardRequest, t: str = Depends(ready), seq: int | None = seq_header
    ):
        return await submit_forward(request, t, model_id, seq, body, True)

    @r.post(
        "/models/{model_id}/forward_only",
        response_model=FutureRef,
        summary="No-gradient forward: per-row log-probs and the loss; result ForwardResult",
    )
    async def forward_only(
        request: Request, model_id: str, body: ForwardRequest, t: str = Depends(ready), seq: int | None = seq_header
    ):
        return await submit_forward(request, t, model_id, seq, body, False)

    @r.post(
        "/models/{model_id}/forward",
        response_model=FutureRef,
        summary="Forward pass (no gradient kept over HTTP): same result as forward_only",
    )
    async def forward(
        request: Request, model_id: str, body: ForwardRequest, t: str = Depends(ready), seq: int | None = seq_header
    ):
        return await submit_forward(request, t, model_id, seq, body, False)

    @r.post(
        "/models/{model_id}/clip_grad_and_step",
        response_model=FutureRef,
        summary="Clip and step on accumulation boundaries; result StepResult",
    )
    async def step(model_id: str, body: StepRequest, t: str = Depends(ready), seq: int | None = seq_header):
        # On the event loop (twinkle/serve/queueing.py): queuing a step is a few journaled rows, while a
        # sync route costs two thread-pool hops (the endpoint and its response model).
        return compute.clip_grad_and_step(t, model_id, seq, body)

    @r.post(
        "/models/{model_id}/calculate_metric",
        response_model=FutureRef,
        summary="Metrics since the last call (then reset); result {name: value}",
    )
    async def metric(model_id: str, body: MetricRequest, t: str = Depends(ready), seq: int | None = seq_header):
        return compute.calculate_metric(t, model_id, seq, body)


def _checkpoint_routes(
    r: PrefixRouter,
    core: Service,
    saving: NativeCheckpoints,
    compute: NativeCompute,
    auth: Auth,
    seq_header: Any,
) -> None:
    """Save, load and resume a model's checkpoints, import a PEFT adapter, log client-side numbers."""
    rt, ready = core.rt, auth.ready

    @r.post(
        "/models/{model_id}/save",
        response_model=FutureRef,
        summary="Save the adapter as a PEFT folder (+ training state); result CheckpointRef",
    )
    def save(model_id: str, body: SaveRequest, t: str = Depends(ready), seq: int | None = seq_header):
        return saving.save(t, model_id, seq, body)

    @r.post(
        "/models/{model_id}/load",
        response_model=FutureRef,
        summary="Load a checkpoint's weights (resume=true: also optimizer/scheduler state)",
    )
    def load(model_id: str, body: LoadRequest, t: str = Depends(ready), seq: int | None = seq_header):
        return saving.load(t, model_id, seq, body)

    imports = AdapterImports(core)

    @r.post(
        "/adapters/import",
        response_model=CheckpointRef,
        summary="Import a PEFT LoRA adapter folder as a training checkpoint (load it into a model to train on)",
    )
    async def import_adapter(body: ImportAdapterRequest, t: str = Depends(ready)):
        def work():
            ckpt = imports.import_adapter(t, rt.engine(body.base_model), body.name, body.files, api="native")
            return CheckpointRef(path=ckpt.tinker_path, model_id=ckpt.model_id)

        return await run_in_threadpool(work)

    @r.post("/models/{model_id}/resume_from_checkpoint", response_model=FutureRef, summary="load with resume=true")
    def resume(model_id: str, body: LoadRequest, t: str = Depends(ready), seq: int | None = seq_header):
        return saving.load(t, model_id, seq, body.model_copy(update={"resume": True}))

    @r.post("/models/{model_id}/log", summary="Record client-side numbers (e.g. reward) on the run's curves")
    def log(model_id: str, body: LogRequest, t: str = Depends(auth.metered)) -> dict:
        return compute.log(t, model_id, body)


def _sample_and_future_routes(
    r: PrefixRouter, core: Service, views: NativeViews, ready: Dependency, tenant: Dependency
) -> None:
    """Sampling, and the futures every submission answers: long-poll and cancel."""
    rt = core.rt

    @r.post(
        "/sample",
        response_model=FutureRef,
        summary="Sample from the base model, a model's adapter or a checkpoint; result SampleResult",
    )
    def sample(body: SampleRequest, t: str = Depends(ready)):
        return views.sample(t, body)

    @r.get(
        "/futures/{request_id}",
        response_model=FutureResult,
        summary="Long-poll a future (up to `timeout` s, then status 'pending')",
    )
    async def future(request_id: str, timeout: float = 25.0, t: str = Depends(tenant)):
        row = await rt.hub.wait(request_id, t, max(0.0, min(timeout, rt.config.long_poll_s)))
        if row is None:
            raise NotFound(f"future {request_id!r} not found")
        if row.status == "pending":
            place = core.where(request_id)
            return FutureResult(
                request_id=request_id,
                status="pending",
                queue_state=place.state,
                queue_reason=place.reason,
            )
        payload = json.loads(row.payload) if row.content_type == "application/json" and row.payload else None
        if row.status == "failed":
            failure = payload if isinstance(payload, dict) else {}
            return FutureResult(
                request_id=request_id, status="failed", error=failure.get("error"), category=failure.get("category")
            )
        return FutureResult(request_id=request_id, status="complete", result=payload)

    @r.post(
        "/futures/{request_id}/cancel",
        summary="Cancel a request: dropped if queued; stopped at its next step (a decode step or micro-batch) "
        "if it runs in slices; status 'cancelled', 'running' (it runs whole and finishes) or 'finished'",
    )
    def cancel(request_id: str, t: str = Depends(tenant)) -> dict:
        return {"request_id": request_id, "status": core.cancel(t, request_id)}


def _read_routes(r: PrefixRouter, views: NativeViews, tenant: Dependency) -> None:
    """What a caller reads: runs, curves, checkpoints and their archives, the server, the result types."""

    @r.get("/runs", response_model=RunList, summary="The caller's training runs (native and Tinker)")
    def runs(limit: int = Query(100, ge=1, le=10_000), t: str = Depends(tenant)):  # SQLite ints are 64-bit
        return views.runs(t, limit)

    @r.get("/runs/{model_id}/curves", response_model=RunCurves, summary="A run's loss/reward/... curves")
    def curves(model_id: str, since_step: int = -1, t: str = Depends(tenant)):
        return views.curves(t, model_id, since_step)

    @r.get("/checkpoints", response_model=CheckpointList, summary="The caller's checkpoints")
    def checkpoints(model_id: str | None = None, t: str = Depends(tenant)):
        return views.checkpoints(t, model_id)

    @r.get(
        "/checkpoints/archive",
        summary="A checkpoint's PEFT folder as a zip",
        response_class=Response,
        responses={200: {"content": {"application/zip": {}}}},
    )
    def archive(path: str, t: str = Depends(tenant)):
        return Response(views.archive(t, path), media_type="application/zip")

    @r.get("/server", response_model=ServerStatus, summary="Capacity (base models, live adapters) and queue")
    def server(t: str = Depends(tenant)):
        return views.status(t)

    @r.get(
        "/result_types",
        response_model=ResultTypes,
        summary="The result model of each future kind (an example of each; for schema readers)",
    )
    def result_types():
        return ResultTypes(
            forward_backward={"loss": 2.5, "metrics": {}},
            clip_grad_and_step={"stepped": True},
            save={"path": "tinker://s:train:0/weights/ckpt", "model_id": "s:train:0"},
            sample={"outputs": []},
            calculate_metric={"loss": 2.5, "step": 1.0},
        )
