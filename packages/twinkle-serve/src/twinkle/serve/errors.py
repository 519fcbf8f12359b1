"""Errors the routes turn into HTTP answers (always with a JSON body: the SDK treats an empty 400 as a glitch)."""

from __future__ import annotations

import json


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


class NotFound(ApiError):
    """Also the answer for another tenant's objects: indistinguishable from absent."""

    status = 404


class Conflict(ApiError):
    status = 409


class ServiceUnavailable(ApiError):
    status = 503


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
