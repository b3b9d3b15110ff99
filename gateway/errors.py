"""One error hierarchy, two body shapes: OpenAI's ``{"error": {"message", "type", "param", "code"}}``
everywhere, and Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under /v1/messages."""

from __future__ import annotations

import logging
import re

import orjson
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

log = logging.getLogger(__name__)


class GatewayError(Exception):
    """Base of every error a client can see; subclasses fix the HTTP status and OpenAI error type."""

    status_code = 500
    error_type = "server_error"
    retry = False  # a refusal the client should retry: the answer says Retry-After: 1

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def headers(self, anthropic: bool) -> dict[str, str] | None:
        """Headers the answer carries (Retry-After on the refusals a client should retry)."""
        return {"Retry-After": "1"} if self.retry else None

    def anthropic_body(self) -> dict:
        return {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPES.get(self.status_code, "api_error"), "message": self.message},
        }


class InvalidRequest(GatewayError):
    status_code = 400
    error_type = "invalid_request_error"


class TooLarge(GatewayError):
    """A part of the request over its size limit (an image's bytes): 413."""

    status_code = 413
    error_type = "invalid_request_error"


class Unauthorized(GatewayError):
    status_code = 401
    error_type = "invalid_request_error"


class PermissionDenied(GatewayError):
    status_code = 403
    error_type = "permission_error"


class NotFound(GatewayError):
    status_code = 404
    error_type = "invalid_request_error"


def not_stored(what: str, ident: str, param: str, code: str = "not_found") -> NotFound:
    """The 404 for a stored object (response, conversation, file, batch) the caller cannot see:
    absent and another key's answer the same, so ids leak nothing across keys."""
    return NotFound(f"No {what} with id {ident!r} is stored here", param=param, code=code)


class Overloaded(GatewayError):
    status_code = 429
    error_type = "rate_limit_error"
    retry = True


class QuotaExceeded(GatewayError):
    """A key's monthly token budget is spent (OpenAI's ``insufficient_quota``: retrying will not help)."""

    status_code = 429
    error_type = "insufficient_quota"


class NoWorkerAvailable(GatewayError):
    status_code = 503
    error_type = "service_unavailable"
    retry = True


class GenerationFailed(GatewayError):
    status_code = 500
    error_type = "server_error"


class WorkerLost(GenerationFailed):
    """The request's worker died and no worker of its model came within the liveness period to take
    it over: nothing was wrong with the request, so a 503 to retry (a batch's line runs again later)
    rather than a 500."""

    status_code = 503
    error_type = "service_unavailable"
    retry = True


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


# Anthropic's error types by status (its overloaded_error is a 529; ours stays a 503).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
ANTHROPIC_PATH = "/v1/messages"


def speaks_anthropic(request: Request) -> bool:
    """Errors under /v1/messages take Anthropic's shape, whatever raised them (a guard, routing, a body);
    so do /v1/models' when the anthropic SDK asks (it sends ``anthropic-version``)."""
    path = request.url.path
    return path.startswith(ANTHROPIC_PATH) or (path.startswith("/v1/models") and "anthropic-version" in request.headers)


def error_response(error: GatewayError, anthropic: bool = False) -> Response:
    body = error.anthropic_body() if anthropic else error.body()
    return Response(
        content=orjson.dumps(body),
        status_code=error.status_code,
        media_type="application/json",
        headers=error.headers(anthropic),
    )


def handle_gateway_error(request: Request, exc: GatewayError) -> Response:
    return error_response(exc, speaks_anthropic(request))


_MISSING = re.compile(r"missing required field `([^`]+)`")


def _body_error(exc: ValidationException) -> InvalidRequest:
    """A body that does not fit its schema: a 400 naming the field (Litestar names the body
    itself, ``data``, when a required field is missing)."""
    problem = exc.extra[0] if isinstance(exc.extra, list) and exc.extra and isinstance(exc.extra[0], dict) else {}
    message, key = str(problem.get("message", exc.detail)), problem.get("key")
    if key == "data" or key is None:
        found = _MISSING.search(message)
        key = found.group(1) if found else None
    return InvalidRequest(f"invalid request body: {message}" + (f" at `{key}`" if key else ""), param=key)


def handle_http_exception(request: Request, exc: HTTPException) -> Response:
    """Litestar's own errors (a body that does not decode, unknown route, wrong method, body too
    large) in the API's shape."""
    if isinstance(exc, ValidationException) and exc.extra:
        return error_response(_body_error(exc), speaks_anthropic(request))
    status = exc.status_code
    if status == 422:  # OpenAI reports validation problems as 400
        status = 400
    error_type = "invalid_request_error" if status < 500 else "server_error"
    error = GatewayError(str(exc.detail))
    error.status_code, error.error_type = status, error_type
    return error_response(error, speaks_anthropic(request))


def handle_bad_encoding(request: Request, exc: UnicodeDecodeError) -> Response:
    """msgspec raises this for invalid UTF-8 inside a JSON string."""
    error = InvalidRequest(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}")
    return error_response(error, speaks_anthropic(request))


def handle_unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error")
    return error_response(GenerationFailed(f"internal error: {type(exc).__name__}"), speaks_anthropic(request))


EXCEPTION_HANDLERS = {
    GatewayError: handle_gateway_error,
    HTTPException: handle_http_exception,
    UnicodeDecodeError: handle_bad_encoding,
    Exception: handle_unexpected,
}
