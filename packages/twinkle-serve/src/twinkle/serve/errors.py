"""Errors the routes turn into HTTP answers (always with a JSON body: the SDK treats an empty 400 as a glitch)."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

log = logging.getLogger("twinkle.serve")


class ApiError(Exception):
    status = 400

    def __init__(self, message: str, headers: dict | None = None):
        super().__init__(message)
        self.message, self.headers = message, headers or {}
        self.extra: dict = {}  # more fields of the JSON body (e.g. which quota refused)


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    """Also the answer for another tenant's objects: indistinguishable from absent."""

    status = 404


class Conflict(ApiError):
    status = 409


class ServiceUnavailable(ApiError):
    status = 503


def internal_error(where: str, exc: BaseException, ref: str | None = None) -> str:
    """Log a fault of the server (its traceback) and return what the client is told: that it is the
    server's, and the reference an operator finds it by in the log; never the exception's text, which
    may name files, paths or code (a tenant's bad input is a typed error answered before this)."""
    ref = ref or uuid.uuid4().hex[:12]
    log.error("internal error %s in %s", ref, where, exc_info=exc)
    return f"internal error: the server failed while handling this request (logged as {ref}); nothing in the request was found wrong"


def server_path_as(message: str, folder, shown: str) -> str:
    """`message` (a library's, naming the files it read) with the server's `folder` said as `shown`: a
    tenant is told about what it sent, never where or how the server keeps it."""
    for form in {str(folder), str(Path(folder).resolve())}:
        message = message.replace(form, shown)
    return message


# ---- answers written by the pure ASGI middlewares (before FastAPI's exception handlers exist) ----
async def send_asgi(send, status: int, body: bytes, content_type: bytes = b"application/json", headers=()) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_asgi_error(send, status: int, message: str, headers=()) -> None:
    await send_asgi(send, status, json.dumps({"error": message, "detail": message}).encode(), headers=headers)
