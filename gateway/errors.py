"""One error hierarchy, one body shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import logging

import orjson
from litestar import Request, Response
from litestar.exceptions import HTTPException

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base of every error a client can see; subclasses fix the HTTP status and OpenAI error type."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    status_code = 401
    error_type = "invalid_request_error"


class NotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"


class Overloaded(GatewayError):
    status_code = 429
    error_type = "rate_limit_error"


class NoWorkerAvailable(GatewayError):
    status_code = 503
    error_type = "service_unavailable"


class GenerationFailed(GatewayError):
    status_code = 500
    error_type = "server_error"


class BadGeneration(GenerationFailed):
    """A worker refused the request for a fault of the request itself (a grammar that does not compile)."""

    status_code = 400
    error_type = "invalid_request_error"


class ClientGone(GatewayError):
    status_code = 499  # nginx's "client closed request": nobody reads it, but logs and metrics do
    error_type = "client_closed_request"


class RequestTimeout(GatewayError):
    status_code = 504
    error_type = "timeout"


def error_response(error: GatewayError) -> Response:
    headers = {"Retry-After": "1"} if isinstance(error, (Overloaded, NoWorkerAvailable)) else None
    return Response(
        content=orjson.dumps(error.body()), status_code=error.status_code, media_type="application/json", headers=headers
    )


def handle_gateway_error(_: Request, exc: GatewayError) -> Response:
    return error_response(exc)


def handle_http_exception(_: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (unknown route, wrong method, body too large) in OpenAI's shape."""
    status = exc.status_code
    if status == 422:  # OpenAI reports validation problems as 400
        status = 400
    error_type = "invalid_request_error" if status < 500 else "server_error"
    error = GatewayError(str(exc.detail), code=None)
    error.status_code, error.error_type = status, error_type
    return error_response(error)


def handle_unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(GenerationFailed(f"internal error: {type(exc).__name__}"))


EXCEPTION_HANDLERS = {
    GatewayError: handle_gateway_error,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected,
}
