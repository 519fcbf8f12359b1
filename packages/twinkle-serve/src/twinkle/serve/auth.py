"""Who is calling: the tenant named by the `X-API-Key` header, for both APIs and the dashboard.

Each route says by its dependency whether it counts against the tenant's requests/s (`metered`) or
not (`unmetered`: polling, liveness and reads the SDK makes on its own), and whether it needs the
models loaded (`ready`). The header is declared as an OpenAPI `APIKeyHeader` security scheme, so
`/docs` offers "Authorize" and its "Try it out" sends the key.

The dependencies are `async def` on purpose: FastAPI runs a sync dependency on its thread pool, a
thread hop each (two per request here), while a key lookup takes microseconds on the event loop.
"""

from __future__ import annotations

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader

from twinkle.serve.errors import Unauthorized
from twinkle.serve.runtime import ServerRuntime

TENANT = "twinkle.tenant"  # the ASGI scope key where the idempotency middleware leaves the caller it looked up
API_KEY = APIKeyHeader(
    name="X-API-Key",
    auto_error=False,
    scheme_name="APIKeyHeader",
    description="A `tml-` key made with `twinkle-server keys create NAME`; its name is the tenant",
)


class Auth:
    def __init__(self, rt: ServerRuntime):
        self.rt = rt
        self.metered = self._caller(metered=True)
        self.unmetered = self._caller(metered=False)

        async def ready(tenant: str = Depends(self.metered)) -> str:
            rt.require_ready()
            return tenant

        self.ready = ready

    def _caller(self, metered: bool):
        rt = self.rt

        async def tenant(request: Request, key: str | None = Security(API_KEY)) -> str:
            name = request.scope.get(TENANT) or rt.keys.tenant_for(key)
            if name is None:
                raise Unauthorized(
                    "missing or invalid API key (header X-API-Key); create one with `twinkle-server keys create NAME`"
                )
            if metered:
                rt.limits.request(name)
            return name

        return tenant
