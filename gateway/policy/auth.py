"""``--api-key``: every route but /health (and the static UI files) wants ``Authorization: Bearer KEY``,
or ``x-api-key: KEY`` as Anthropic's clients send it. ``--admin-key`` guards the operator's routes
(``GET /v1/usage``, ``/admin/keys``) and turns managed keys on (gateway/state/keys.py): the API then
wants one of them or a ``--api-key`` key. What a caller stores belongs to its key (``caller_owner``);
a managed key's record, limits and ``default_priority`` travel with its request (``caller_key``)."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import Unauthorized
from gateway.policy.priority import batch_owner
from gateway.state.keys import KeyRecord
from gateway.state.records import owner_of


def parse_keys(option: str | None) -> frozenset[str]:
    """``--api-key`` holds one key or several, comma-separated."""
    return frozenset(k.strip() for k in (option or "").split(",") if k.strip())


def presented_key(connection: ASGIConnection) -> str:
    header = connection.headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else connection.headers.get("x-api-key", "").strip()


def _matches(token: str, keys: frozenset[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


def api_key_guard(keys: frozenset[str], managed: bool = False):
    """A ``--api-key`` key, or (``managed``) an active managed key, whose record the request then carries."""

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if batch_owner(connection) is not None:
            return  # the batch runner's own call, for the key that created the batch
        token = presented_key(connection)
        if keys and _matches(token, keys):
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
        if not admin_keys or not _matches(presented_key(connection), admin_keys):
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


def default_priority(connection: ASGIConnection) -> int | None:
    """The priority of a request that names none: its managed key's ``default_priority``, if any."""
    key = caller_key(connection)
    return None if key is None else key.default_priority


def caller_owner(connection: ASGIConnection) -> str:
    """Whose stored responses a request sees: its key's digest when the server has keys ('' when
    it has none, so an open server keeps one shared store as before). A batch's requests belong to
    the key that created the batch."""
    owner = batch_owner(connection)
    if owner is not None:
        return owner
    if caller_key(connection) is None and not getattr(connection.app.state, "api_keys", None):
        return ""
    return owner_of(presented_key(connection))
