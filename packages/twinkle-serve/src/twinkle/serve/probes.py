"""Probes for orchestrators, which call without credentials: `/livez` (the process answers) and
`/readyz` (the base models are loaded). They say nothing more; the detailed status (a load error's
text, capacity, queues) stays behind the API key (`/api/v1/healthz`, `/twinkle/v1/server`)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from twinkle.serve.runtime import ServerRuntime


def build_probe_router(rt: ServerRuntime) -> APIRouter:
    r = APIRouter(tags=["probes"])

    @r.get("/livez", summary="Liveness: 200 while the server process answers (no key needed)")
    def livez():
        return {"status": "alive"}

    @r.get("/readyz", summary="Readiness: 200 once the base models are loaded, else 503 (no key needed)")
    def readyz():
        if rt.draining:  # SIGTERM: an orchestrator should stop routing here while accepted work finishes
            return JSONResponse({"status": "draining"}, status_code=503)
        if rt.ready.is_set():
            return {"status": "ready"}
        return JSONResponse({"status": "failed" if rt.load_error is not None else "loading"}, status_code=503)

    return r
