"""Errors the routes turn into HTTP answers (always with a JSON body: the SDK treats an empty 400 as a glitch)."""

from __future__ import annotations


class ApiError(Exception):
    status = 400

    def __init__(self, message: str, headers: dict | None = None):
        super().__init__(message)
        self.message, self.headers = message, headers or {}


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class NotFound(ApiError):
    """Also the answer for another tenant's objects: indistinguishable from absent."""

    status = 404


class Conflict(ApiError):
    status = 409
