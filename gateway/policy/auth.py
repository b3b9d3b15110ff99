"""``--api-key``: every route but /health (and the static UI files) wants ``Authorization: Bearer KEY``,
or ``x-api-key: KEY`` as Anthropic's clients send it. ``--admin-key`` guards the operator's routes
(``GET /v1/usage``, ``/admin/keys``) and turns managed keys on (gateway/state/keys.py): the API then
wants one of them or a ``--api-key`` key. What a caller stores belongs to its key (``owner``); a
managed key's record, limits and ``default_priority`` travel with its request (its ``Caller``).

The rules only: the guards that read the keys from a request's headers are gateway/http/auth.py."""

from __future__ import annotations

import hmac

from gateway.state.keys import KeyRecord
from gateway.state.records import owner_of


def parse_keys(option: str | None) -> frozenset[str]:
    """``--api-key`` holds one key or several, comma-separated."""
    return frozenset(k.strip() for k in (option or "").split(",") if k.strip())


def matches(token: str, keys: frozenset[str]) -> bool:
    return any(hmac.compare_digest(token.encode(), key.encode()) for key in keys)


def owner(token: str, managed: KeyRecord | None, api_keys: frozenset[str] | None) -> str:
    """Whose stored responses a request with key ``token`` sees: its key's digest when the server
    has keys ('' when it has none, so an open server keeps one shared store as before)."""
    if managed is None and not api_keys:
        return ""
    return owner_of(token)
