"""Request bodies over `max_request_bytes` answer 413 before any route reads them into memory.

A pure ASGI middleware: a declared Content-Length over the limit is refused at once (the HTTP server
itself never delivers more than a declared length). A body sent without one (chunked) is read here,
counted as it streams, refused as soon as it passes the limit, and otherwise replayed to the route
whole: an error raised from inside a route's own body parsing would be caught by FastAPI's request
validation and answered 400, so the limit must be decided before the route runs.
"""

from __future__ import annotations

from twinkle.serve.errors import send_asgi_error


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send, detail: str) -> None:
        await send_asgi_error(send, 413, detail, headers=[(b"connection", b"close")])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit() or int(declared) > limit:
                return await self._refuse(
                    send,
                    f"request body of {declared.decode(errors='replace')} bytes is over "
                    f"this server's limit of {limit} bytes (max_request_bytes)",
                )
            return await self.app(scope, receive, send)
        chunks, seen = [], 0
        while True:  # no declared length: read (at most limit + one chunk) before the route runs
            message = await receive()
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > limit:
                return await self._refuse(
                    send, f"request body is over this server's limit of {limit} bytes (max_request_bytes)"
                )
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)
