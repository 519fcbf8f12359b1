"""Request bodies over `max_request_bytes` answer 413 before any route reads them into memory.

A pure ASGI middleware: a declared Content-Length over the limit is refused at once; a body sent
without one (chunked) is counted as it streams and refused as soon as it passes the limit.
"""

from __future__ import annotations

import json


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send, detail: str) -> None:
        body = json.dumps({"error": detail, "detail": detail}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._refuse(send, f"request body of {declared.decode(errors='replace')} bytes is over "
                                            f"this server's limit of {limit} bytes (max_request_bytes)")
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except _TooLarge:
            if started:
                raise
            await self._refuse(send, f"request body is over this server's limit of {limit} bytes (max_request_bytes)")
