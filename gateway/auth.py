"""``--api-key``: every route but /health (and the static UI files) wants ``Authorization: Bearer KEY``,
or ``x-api-key: KEY`` as Anthropic's clients send it."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from gateway.errors import Unauthorized


def parse_keys(option: str | None) -> frozenset[str]:
    """``--api-key`` holds one key or several, comma-separated."""
    return frozenset(k.strip() for k in (option or "").split(",") if k.strip())


def api_key_guard(keys: frozenset[str]):
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        header = connection.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else connection.headers.get("x-api-key", "").strip()
        if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
            raise Unauthorized("Incorrect or missing API key: send it as `Authorization: Bearer KEY` (or `x-api-key: KEY`)", code="invalid_api_key")

    return guard
