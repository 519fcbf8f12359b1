"""The Tinker routes of the services around the training loop (tinker/routes.py has the loop itself:
sessions, models, passes, sampling, futures, weights, runs), under /api/v1: server-side custom losses,
the sampling completion queue (`retrieve_futures`, `cancel_future`, `join_sampling_session`), adapter
imports, external weights and their signed download URLs, copies, session search/project/trace, the
API key's own record, usage (counted in real tokens; what is not recorded says so), storage and audit.

Every route needs `X-API-Key` (the key's name is the tenant) except the signed file downloads, whose
URL is the credential. Another tenant's object is a 404, a malformed body a 400 naming the field.
"""

from __future__ import annotations

from fastapi import Depends, Request
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from twinkle.serve.auth import Auth
from twinkle.serve.core import audit as audit_log
from twinkle.serve.core.adapter_import import AdapterImports
from twinkle.serve.core.service import Service
from twinkle.serve.routing import PrefixRouter
from twinkle.serve.runtime import ServerRuntime
from twinkle.serve.tinker import bodies as b
from twinkle.serve.tinker import custom_loss_service, model_names, sampling_queue, sessions, usage
from twinkle.serve.tinker.external_weights import ExternalWeights, UrlSigner
from twinkle.serve.tinker.models import TinkerModels
from twinkle.serve.tinker.routes import Dependency, read
from twinkle.serve.tinker.sampling import TinkerSampling
from twinkle.serve.tinker.weights import TinkerWeights


def build_services_router(svc: Service) -> PrefixRouter:
    rt, auth = svc.rt, Auth(svc.rt)
    # the SDK polls retrieve_futures on its own (like retrieve_future): not metered
    caller, poller = auth.metered, auth.unmetered
    sampling = TinkerSampling(svc)
    weights = TinkerWeights(svc, TinkerModels(svc), sampling)
    signer = UrlSigner()  # signs the checkpoint-file and session-trace URLs

    r = PrefixRouter("/api/v1", tags=["tinker"])
    # in this order: the OpenAPI document lists the routes as they are added
    _loss_and_sampling_queue_routes(r, svc, sampling, caller, poller)
    _import_route(r, svc, auth.ready)
    _external_weights_routes(r, svc, weights, signer, caller, auth.ready)
    _session_routes(r, svc, signer, caller)
    _account_routes(r, rt, caller)
    return r


def _loss_and_sampling_queue_routes(
    r: PrefixRouter, svc: Service, sampling: TinkerSampling, caller: Dependency, poller: Dependency
) -> None:
    """Server-side custom losses, and the sampling completion queue."""

    @r.post("/create_custom_loss", openapi_extra=b.documented(b.CreateCustomLossBody))
    async def create_custom_loss(request: Request, t: str = Depends(caller)):
        body = await read(request, b.CreateCustomLossBody)
        return await run_in_threadpool(custom_loss_service.create, svc, t, body)

    @r.post("/retrieve_futures", openapi_extra=b.documented(b.FuturesRetrieveBody))
    async def retrieve_futures(request: Request, t: str = Depends(poller)):
        return await sampling_queue.retrieve_futures(sampling, t, await read(request, b.FuturesRetrieveBody))

    @r.post("/cancel_future", openapi_extra=b.documented(b.FutureBody))
    async def cancel_future(request: Request, t: str = Depends(caller)):
        return await run_in_threadpool(sampling_queue.cancel_future, svc, t, await read(request, b.FutureBody))

    @r.post("/join_sampling_session", openapi_extra=b.documented(b.JoinSamplingSessionBody))
    async def join_sampling_session(request: Request, t: str = Depends(caller)):
        body = await read(request, b.JoinSamplingSessionBody)
        return await run_in_threadpool(sampling_queue.join_sampling_session, sampling, t, body)


def _import_route(r: PrefixRouter, svc: Service, ready: Dependency) -> None:
    """A PEFT adapter made elsewhere, as a training checkpoint (twinkle.serve.core.adapter_import)."""
    rt = svc.rt
    imports = AdapterImports(svc)

    def import_adapter(t: str, body: b.ImportAdapterBody) -> dict:
        if body.session_id is not None:  # another tenant's session: a 404 before the files are read
            svc.session(t, body.session_id)
        engine = model_names.engine(rt, body.base_model)  # `<base>:peft:<n>` too
        ckpt = imports.import_adapter(t, engine, body.name, body.files, body.session_id)
        return {"type": "import_adapter", "path": ckpt.tinker_path, "model_id": ckpt.model_id}

    @r.post("/import_adapter", openapi_extra=b.documented(b.ImportAdapterBody))
    async def import_adapter_route(request: Request, t: str = Depends(ready)):
        return await run_in_threadpool(import_adapter, t, await read(request, b.ImportAdapterBody))


def _external_weights_routes(
    r: PrefixRouter,
    svc: Service,
    weights: TinkerWeights,
    signer: UrlSigner,
    caller: Dependency,
    ready: Dependency,
) -> None:
    """External weights: export, signed URLs, the files themselves; copies."""
    external = ExternalWeights(svc, signer)

    @r.post("/save_weights_external", openapi_extra=b.documented(b.SaveWeightsExternalBody))
    async def save_weights_external(request: Request, t: str = Depends(ready)):
        body = await read(request, b.SaveWeightsExternalBody)
        return await run_in_threadpool(weights.save_weights_external, t, body)

    @r.get("/training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls")
    def external_weights_urls(run_id: str, kind: str, name: str, request: Request, t: str = Depends(caller)):
        return external.urls(t, str(request.base_url), run_id, f"{kind}/{name}")

    @r.get("/checkpoint_files/{token}")
    def checkpoint_file(token: str):  # no API key: the signed token is the credential
        path, name = external.file(token)
        return FileResponse(path, filename=name)

    @r.post("/copy_weights", openapi_extra=b.documented(b.CopyWeightsBody))
    async def copy_weights(request: Request, t: str = Depends(caller)):
        body = await read(request, b.CopyWeightsBody)
        return await run_in_threadpool(sessions.copy_weights, svc, weights, t, body)


def _session_routes(r: PrefixRouter, svc: Service, signer: UrlSigner, caller: Dependency) -> None:
    """Sessions: search, project, trace."""

    @r.post("/sessions/search", openapi_extra=b.documented(b.SessionSearchBody))
    async def search_sessions(request: Request, t: str = Depends(caller)):
        return sessions.search(svc, t, await read(request, b.SessionSearchBody))

    @r.put("/sessions/{session_id}/project", openapi_extra=b.documented(b.ProjectBody))
    async def session_project(session_id: str, request: Request, t: str = Depends(caller)):
        return sessions.set_project(svc, t, session_id, await read(request, b.ProjectBody))

    @r.get("/sessions/{session_id}/trace_export")
    def trace_export(session_id: str, request: Request, t: str = Depends(caller)):
        return sessions.trace_url(svc, signer, t, session_id, str(request.base_url))

    @r.get("/session_traces/{token}")
    def session_trace(token: str):  # no API key: the signed token is the credential
        return Response(sessions.trace(svc, signer, token), media_type="application/json")


def _account_routes(r: PrefixRouter, rt: ServerRuntime, caller: Dependency) -> None:
    """The key's own record, usage, storage and audit."""

    @r.get("/auth/apikey/me")
    def api_key_me(t: str = Depends(caller)):
        return usage.api_key_record(rt.store, t)

    @r.delete("/auth/apikey/me")
    def delete_api_key_me(t: str = Depends(caller)):
        rt.keys.revoke(t)  # `tinker auth logout`: this key, and only this key
        return {"status": "revoked", "name": t}

    @r.get("/billing/usage/events")
    def billing_usage(starting_on: str | None = None, ending_before: str | None = None, t: str = Depends(caller)):
        return usage.usage_events(rt.store, t, starting_on, ending_before)

    @r.get("/billing/usage/checkpoints/current")
    def checkpoint_storage(request: Request, t: str = Depends(caller)):
        # project_id is a label on the caller's own sessions, not an object id: read from the query
        return usage.checkpoint_storage(rt.store, t, request.query_params.get("project_id"))

    @r.get("/audit")
    def audit(event_type: str = "all", day: str | None = None, t: str = Depends(caller)):
        return audit_log.entries(rt.store, t, event_type, day)
