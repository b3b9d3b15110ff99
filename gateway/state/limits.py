"""What a stored response may hold: OpenAI's limits on ``metadata`` and ``user``, and a byte budget.

Bodies are kept as the client sent them, so without these one client could store megabytes per
request (3.9 MB of metadata each, before). A request over a limit is a 400 naming the field before
any work is done.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
MAX_USER = 64


def check_metadata(metadata: Any, param: str = "metadata") -> dict[str, str]:
    """At most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise InvalidRequest(f"`{param}` must be an object of string values", param=param)
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"`{param}` holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed", param=param
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise InvalidRequest(
                f"`{param}` key {key[:20]!r}... is {len(key)} characters long; at most {MAX_METADATA_KEY} are allowed",
                param=param,
            )
        if not isinstance(value, str):
            raise InvalidRequest(f"`{param}.{key}` must be a string", param=f"{param}.{key}")
        if len(value) > MAX_METADATA_VALUE:
            raise InvalidRequest(
                f"`{param}.{key}` is {len(value)} characters long; at most {MAX_METADATA_VALUE} are allowed",
                param=f"{param}.{key}",
            )
    return metadata


def check_user(user: str | None) -> None:
    if user is not None and len(user) > MAX_USER:
        raise InvalidRequest(f"`user` is {len(user)} characters long; at most {MAX_USER} are allowed", param="user")


def check_budget(size: int, limit: int, param: str = "input") -> None:
    """A stored response's own bytes (its input items, instructions, tools, metadata) within
    ``--state-max-response-bytes``; the output is bounded by the model's context."""
    if size > limit:
        raise InvalidRequest(
            f"the response would store {size} bytes, more than --state-max-response-bytes ({limit}); send it with `store: false`",
            param=param,
            code="response_too_large",
        )
