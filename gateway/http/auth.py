"""The caller as its HTTP request shows it: the API-key guards (the rules are
gateway/policy/auth.py), the ``Caller`` record the routes hand the core (``caller_of``, a Litestar
dependency), and the rate headers an admitted request's answer carries."""

from __future__ import annotations

from functools import partial

from litestar import Request
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import ANTHROPIC_PATH, Unauthorized
from gateway.policy.auth import matches, owner
from gateway.policy.caller import Caller
from gateway.policy.priority import BATCH_SCOPE
from gateway.state.keys import KeyRecord


def presented_key(connection: ASGIConnection) -> str:
    header = connection.headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else connection.headers.get("x-api-key", "").strip()


def batch_owner(connection: ASGIConnection) -> str | None:
    """The owner of the batch this call runs for, when the batch runner made it (else None)."""
    return connection.scope.get(BATCH_SCOPE)  # type: ignore[return-value]


def api_key_guard(keys: frozenset[str], managed: bool = False):
    """A ``--api-key`` key, or (``managed``) an active managed key, whose record the request then carries."""

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if batch_owner(connection) is not None:
            return  # the batch runner's own call, for the key that created the batch
        token = presented_key(connection)
        if keys and matches(token, keys):
            return
        key = await connection.app.state.quotas.cache.lookup(token) if managed and token else None
        if key is not None:
            connection.scope.setdefault("state", {})["api_key"] = key
        else:
            raise Unauthorized(
                "Incorrect or missing API key: send it as `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
                code="invalid_api_key",
            )

    return guard


def admin_guard(admin_keys: frozenset[str]):
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if not admin_keys or not matches(presented_key(connection), admin_keys):
            why = (
                "this route wants the admin key (--admin-key)"
                if admin_keys
                else "no --admin-key is set, so this route is closed"
            )
            raise Unauthorized(f"Incorrect or missing admin key: {why}", code="invalid_api_key")

    return guard


def caller_key(connection: ASGIConnection) -> KeyRecord | None:
    """The managed key a request was made with (None: a ``--api-key`` key, or an open server)."""
    return connection.scope.get("state", {}).get("api_key")


def caller_owner(connection: ASGIConnection) -> str:
    """Whose stored objects a request sees (gateway/policy/auth.py's ``owner``); a batch's requests
    belong to the key that created the batch."""
    batch = batch_owner(connection)
    if batch is not None:
        return batch
    return owner(presented_key(connection), caller_key(connection), getattr(connection.app.state, "api_keys", None))


async def _hang_up(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def caller_of(request: Request) -> Caller:
    """The request's caller record (Litestar's ``caller`` dependency): made once per request and
    kept in its scope, where ``rate_headers`` finds the limits quotas left on it."""
    state = request.scope.setdefault("state", {})
    if "caller" not in state:
        client = request.scope.get("client")
        state["caller"] = Caller(
            owner=caller_owner(request),
            key=caller_key(request),
            batch=batch_owner(request) is not None,
            request_id=request.headers.get("x-request-id"),
            session_id=request.headers.get("x-session-id"),
            address=client[0] if client else None,
            disconnected=partial(_hang_up, request),
        )
    return state["caller"]


def rate_headers(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: an admitted request's answer carries its key's rate headers too, as OpenAI's
    and Anthropic's do (the refusals carry them through ``RateLimited``)."""

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def sending(message: Message) -> None:
            caller = scope.get("state", {}).get("caller") if message["type"] == "http.response.start" else None
            rate = caller.rate if caller is not None else None
            if rate is not None and message["status"] < 400:
                anthropic = scope["path"].startswith(ANTHROPIC_PATH)
                extra = [(k.encode(), v.encode()) for k, v in rate.headers(anthropic).items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await app(scope, receive, sending)

    return handle
