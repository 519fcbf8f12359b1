"""OpenAI's error shape for every failure on the /v1 routes, the auth and body checks included.

The OpenAI clients read `{"error": {"message", "type", "param", "code"}}`; the rest of the server
answers `{"error": "..."}`. A route class (not the app's exception handlers, which serve the other
APIs) converts this API's failures, so it also covers errors raised while resolving dependencies.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from twinkle.serve.backend import UserError
from twinkle.serve.errors import ApiError
from twinkle.serve.limits import LimitExceeded

_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "server_error",
}


class OpenAIError(ApiError):
    """An ApiError that also names the offending parameter and OpenAI's error code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """`{"error": {...}}`: an error status's body, and the event that ends a stream which fails midway."""
    kind = _TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return f"unsupported parameter {param!r}: this server does not implement it", param
    return f"invalid {param or 'request body'}: {first.get('msg')}", param


class OpenAIRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def answer(request):
            try:
                return await handler(request)
            except OpenAIError as e:
                return error_response(e.status, e.message, e.param, e.code, e.headers)
            except ApiError as e:
                return error_response(e.status, e.message, headers=e.headers)
            except RequestValidationError as e:
                return error_response(400, *_validation_message(e))
            except LimitExceeded as e:
                return error_response(
                    429, str(e), code="rate_limit_exceeded", headers={"Retry-After": str(e.retry_after)}
                )
            except UserError as e:
                return error_response(400, str(e))

        return answer
