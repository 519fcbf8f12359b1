"""The Tinker-compatible HTTP API under /api/v1 (the tinker SDK 0.38 is the specification).

Every route needs `X-API-Key` of a known, unrevoked key; the key's name is the tenant. Submitting
routes answer a future (`{request_id}`); `retrieve_future` long-polls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Depends, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from twinkle.serve.auth import Auth
from twinkle.serve.core import bounds
from twinkle.serve.core.service import Service
from twinkle.serve.core.work import PROTO
from twinkle.serve.errors import BadRequest, NotFound
from twinkle.serve.queueing import queue_work
from twinkle.serve.routing import PrefixRouter
from twinkle.serve.runtime import ServerRuntime
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker import model_names
from twinkle.serve.tinker.models import TinkerModels
from twinkle.serve.tinker.rest import TinkerRest
from twinkle.serve.tinker.sampling import TinkerSampling
from twinkle.serve.tinker.weights import TinkerWeights

# Flags for /client/config: the simplest transport the SDK supports (see tinker-contract.md §1).
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": True,
    "sample_join_sampling_session": False,
}


async def json_body(request: Request) -> dict:
    """The request's JSON object; a missing, malformed or non-object body is the client's error (400)."""
    caps = request.app.state.runtime.config.caps
    try:
        body = await request.json()
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise BadRequest(f"request body must be a JSON object: {e}") from None
    except RecursionError:  # the parser's own limit, far past caps.max_json_depth
        raise BadRequest(f"request body nests deeper than {caps.max_json_depth} levels (caps.max_json_depth)") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    bounds.json_depth("request body", body, caps)
    return body


M = TypeVar("M", bound=BaseModel)


async def read(request: Request, model: type[M]) -> M:
    """The request's JSON object parsed as `model`: every field's type and range checked before a route
    reads any (a 400 naming the first that does not fit)."""
    return b.parse(model, await json_body(request))


Dependency = Callable[..., Any]  # an Auth dependency: resolves to the caller's tenant


def build_router(svc: Service) -> PrefixRouter:
    rt, auth = svc.rt, Auth(svc.rt)
    models, sampling, rest = TinkerModels(svc), TinkerSampling(svc), TinkerRest(svc)
    weights = TinkerWeights(svc, models, sampling)
    # Polling and liveness calls are not counted against requests/s: the SDK makes them on its own.
    tenant, unmetered, ready_tenant = auth.metered, auth.unmetered, auth.ready

    r = PrefixRouter("/api/v1", tags=["tinker"])
    # in this order: the OpenAPI document lists the routes as they are added
    _bootstrap_routes(r, rt, tenant, unmetered, ready_tenant)
    _session_routes(r, models, rest, tenant, unmetered)
    _training_routes(r, models, sampling, weights, tenant, ready_tenant)
    _future_route(r, svc, unmetered)
    _rest_routes(r, rest, tenant)
    return r


def _bootstrap_routes(
    r: PrefixRouter, rt: ServerRuntime, tenant: Dependency, unmetered: Dependency, ready_tenant: Dependency
) -> None:
    """What the SDK asks before it starts: its client config, liveness, the server's models."""

    @r.post("/client/config")
    def client_config(t: str = Depends(tenant)):
        return CLIENT_CONFIG

    @r.post("/client/dynamic_config")
    def dynamic_config(t: str = Depends(tenant)):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": True}  # cancel_future: routes_services.py

    @r.get("/healthz")
    def healthz(t: str = Depends(unmetered)):
        if rt.load_error is not None:
            return JSONResponse({"status": "failed", "error": rt.load_error}, status_code=503)
        if not rt.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @r.get("/get_server_capabilities")
    def capabilities(t: str = Depends(ready_tenant)):
        return {"supported_models": model_names.capabilities(rt)}  # with each model's caps


def _session_routes(
    r: PrefixRouter, models: TinkerModels, rest: TinkerRest, tenant: Dependency, unmetered: Dependency
) -> None:
    """Sessions (create, heartbeat, finish, list, read) and the SDK's telemetry."""

    @r.post("/create_session", openapi_extra=b.documented(b.CreateSessionBody))
    async def create_session(request: Request, t: str = Depends(tenant)):
        return await run_in_threadpool(models.create_session, t, await read(request, b.CreateSessionBody))

    @r.post("/session_heartbeat", openapi_extra=b.documented(b.SessionRef))
    async def heartbeat(request: Request, t: str = Depends(unmetered)):
        return await run_in_threadpool(models.heartbeat, t, await read(request, b.SessionRef))

    @r.post("/sessions/{session_id}/finish", openapi_extra=b.documented(b.FinishSessionBody))
    async def finish(session_id: str, request: Request, t: str = Depends(tenant)):
        body = await read(request, b.FinishSessionBody) if await request.body() else b.FinishSessionBody()
        await run_in_threadpool(models.finish_session, t, session_id, body)
        return {"status": "finished"}

    @r.post("/telemetry")
    def telemetry(t: str = Depends(unmetered)):
        return {"status": "accepted"}

    @r.get("/sessions")
    def sessions(
        limit: int = Query(20, ge=0, le=1000), offset: int = Query(0, ge=0, le=2**62), t: str = Depends(tenant)
    ):
        return rest.list_sessions(t, limit, offset)

    @r.get("/sessions/{session_id}")
    def session(session_id: str, t: str = Depends(tenant)):
        return rest.get_session(t, session_id)


def _training_routes(
    r: PrefixRouter,
    models: TinkerModels,
    sampling: TinkerSampling,
    weights: TinkerWeights,
    tenant: Dependency,
    ready_tenant: Dependency,
) -> None:
    """The training loop's submissions: models, passes, the step, weights, sampling sessions and samples."""

    def json_route(path: str, fn, body_model: type[BaseModel], per_step: bool = False):
        async def handler(request: Request, t: str = Depends(ready_tenant)):
            return await queue_work(request, fn, t, await read(request, body_model), light=per_step)

        handler.__name__ = path.strip("/")
        r.add_api_route(path, handler, methods=["POST"], openapi_extra=b.documented(body_model))

    json_route("/create_model", models.create_model, b.CreateModelBody)
    json_route("/get_info", models.get_info, b.ModelRef)
    json_route("/optim_step", models.optim_step, b.OptimStepBody, per_step=True)
    json_route("/save_weights", weights.save_weights, b.SaveWeightsBody)
    json_route("/save_weights_for_sampler", weights.save_weights_for_sampler, b.SaveWeightsForSamplerBody)
    json_route("/load_weights", weights.load_weights, b.LoadWeightsBody)
    json_route("/create_sampling_session", sampling.create_sampling_session, b.CreateSamplingSessionBody)
    json_route("/asample", sampling.asample, b.ASampleBody, per_step=True)

    @r.post(
        "/forward_backward",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/x-protobuf": {
                        "schema": {
                            "type": "string",
                            "format": "binary",
                            "description": "tinker ForwardBackwardRequest (protobuf)",
                        }
                    }
                },
            }
        },
    )
    async def forward_backward(request: Request, t: str = Depends(ready_tenant)):
        return await queue_work(request, models.forward_backward, t, await request.body())

    @r.get("/samplers/{sampler_id}")
    def sampler(sampler_id: str, t: str = Depends(tenant)):
        return sampling.get_sampler(t, sampler_id)


def _future_route(r: PrefixRouter, svc: Service, unmetered: Dependency) -> None:
    """`retrieve_future`: the long poll every submission is answered through."""
    rt = svc.rt

    @r.post("/retrieve_future", openapi_extra=b.documented(b.FutureBody))
    async def retrieve_future(request: Request, t: str = Depends(unmetered)):
        request_id = (await read(request, b.FutureBody)).request_id
        row = await rt.hub.wait(request_id, t, rt.config.long_poll_s)
        if row is None:
            raise NotFound(f"future {request_id!r} not found")
        if row.status == "pending":  # where it waits, as the SDK's TryAgainResponse carries it
            place = svc.where(request_id)
            return {
                "type": "try_again",
                "request_id": request_id,
                "queue_state": place.state,
                "queue_state_reason": place.reason,
            }
        return Response(row.payload, media_type=PROTO if row.content_type == PROTO else "application/json")


def _rest_routes(r: PrefixRouter, rest: TinkerRest, tenant: Dependency) -> None:
    """Training runs and their checkpoints: list, read, delete, publish, TTL, weights info."""

    @r.get("/training_runs")
    def runs(limit: int = Query(20, ge=0, le=1000), offset: int = Query(0, ge=0, le=2**62), t: str = Depends(tenant)):
        return rest.list_runs(t, limit, offset)

    @r.get("/training_runs/{run_id}")
    def run(run_id: str, t: str = Depends(tenant)):
        return rest.get_run(t, run_id)

    @r.get("/training_runs/{run_id}/checkpoints")
    def checkpoints(run_id: str, t: str = Depends(tenant)):
        return rest.list_checkpoints(t, run_id)

    @r.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}")
    def delete_checkpoint(run_id: str, kind: str, name: str, t: str = Depends(tenant)):
        rest.delete_checkpoint(t, run_id, f"{kind}/{name}")
        return {"status": "deleted"}

    @r.post("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    def publish(run_id: str, kind: str, name: str, t: str = Depends(tenant)):
        rest.set_public(t, run_id, f"{kind}/{name}", True)
        return {"status": "published"}

    @r.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}/publish")
    def unpublish(run_id: str, kind: str, name: str, t: str = Depends(tenant)):
        rest.set_public(t, run_id, f"{kind}/{name}", False)
        return {"status": "unpublished"}

    @r.put("/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl", openapi_extra=b.documented(b.TtlBody))
    async def ttl(run_id: str, kind: str, name: str, request: Request, t: str = Depends(tenant)):
        rest.set_ttl(t, run_id, f"{kind}/{name}", (await read(request, b.TtlBody)).ttl_seconds)
        return {"status": "ok"}

    @r.post("/weights_info", openapi_extra=b.documented(b.WeightsInfoBody))
    async def weights_info(request: Request, t: str = Depends(tenant)):
        return rest.weights_info(t, (await read(request, b.WeightsInfoBody)).tinker_path)

    @r.get("/checkpoints")
    def user_checkpoints(
        limit: int = Query(100, ge=0, le=1000), offset: int = Query(0, ge=0, le=2**62), t: str = Depends(tenant)
    ):
        return rest.list_user_checkpoints(t, limit, offset)
