"""The FastAPI application: error mapping, startup (model loading in the background), the Tinker routes."""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from twinkle.serve.backend import UserError
from twinkle.serve.body_limit import BodyLimit
from twinkle.serve.core.service import Service
from twinkle.serve.dashboard import build_dashboard_router
from twinkle.serve.errors import ApiError, internal_error
from twinkle.serve.idempotency import Idempotency
from twinkle.serve.limits import LimitExceeded
from twinkle.serve.native import build_native_router
from twinkle.serve.openai import build_openai_router
from twinkle.serve.probes import build_probe_router
from twinkle.serve.prometheus import RequestMetrics, build_metrics_router
from twinkle.serve.runtime import ServerRuntime
from twinkle.serve.tinker.routes import build_router
from twinkle.serve.tinker.routes_services import build_services_router

log = logging.getLogger("twinkle.serve")


def create_app(rt: ServerRuntime) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        rt.hub.bind_loop(asyncio.get_running_loop())
        if not rt.ready.is_set() and not rt.engines:
            threading.Thread(target=_load, args=(rt,), name="twinkle-load", daemon=True).start()
        yield

    app = FastAPI(title="twinkle-serve", lifespan=lifespan)
    app.state.runtime = rt

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(
            {"error": exc.message, "detail": exc.message, **exc.extra}, status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(LimitExceeded)
    async def limited(request: Request, exc: LimitExceeded):
        # x-should-retry: the SDK backs off and retries on its own, honouring Retry-After.
        return JSONResponse(
            {"error": str(exc), "detail": str(exc)}, status_code=429, headers={"Retry-After": str(exc.retry_after)}
        )

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # FastAPI's own answer, but one naming field, value and range in `error`, and never a 500 for a
        # NaN or inf the client sent (JSON cannot carry them back: they are echoed as strings)
        detail = _json_safe(jsonable_encoder(exc.errors()))
        first = detail[0] if detail else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc or 'body'} = {first.get('input')!r}: {first.get('msg')}"
        return JSONResponse({"error": message, "detail": detail}, status_code=422)

    @app.exception_handler(UserError)
    async def user_error(request: Request, exc: UserError):
        return JSONResponse({"error": str(exc), "detail": str(exc), "category": "user"}, status_code=400)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        # a bug, not the request: logged with its traceback, answered without internals (errors.internal_error)
        message = internal_error(f"{request.method} {request.url.path}", exc)
        return JSONResponse({"error": message, "detail": message, "category": "server"}, status_code=500)

    # Starlette wraps middleware in reverse order: BodyLimit runs first, so Idempotency never buffers
    # an oversized body.
    app.add_middleware(Idempotency, store=rt.store, keys=rt.keys, caps=rt.config.caps, metrics=rt.metrics)
    app.add_middleware(BodyLimit, max_bytes=rt.config.max_request_bytes)
    app.add_middleware(RequestMetrics, metrics=rt.metrics)  # outermost: sees every answer, 413s included
    app.include_router(build_probe_router(rt))
    app.include_router(build_metrics_router(rt.metrics))
    core = Service(rt)  # both APIs are translations over this one service core
    app.include_router(build_router(core))
    app.include_router(build_services_router(core))  # the rest of the SDK 0.38 routes
    native, native_views = build_native_router(core)
    app.include_router(native)
    app.include_router(build_dashboard_router(native_views))
    app.include_router(build_openai_router(core))  # the OpenAI-compatible API (twinkle.serve.openai)
    _document_tinker_bodies(app)
    return app


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _document_tinker_bodies(app: FastAPI) -> None:
    """Add the Tinker routes' typed bodies (declared through `openapi_extra`) to the schema's components."""
    from twinkle.serve.tinker.bodies import SCHEMAS

    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()  # fastapi keeps it as app.openapi_schema
        schema.setdefault("components", {}).setdefault("schemas", {}).update(SCHEMAS)
        return schema

    app.openapi = openapi


def _load(rt: ServerRuntime) -> None:
    try:
        rt.load_models()
    except Exception:
        log.exception("loading the base models failed")
