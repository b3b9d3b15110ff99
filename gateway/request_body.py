"""Request bodies are checked for nesting depth before they are decoded: JSON nested thousands of
levels deep (even in a field nobody reads) made the decoder raise RecursionError, a 500, and
anything that walks a decoded value (schemas, templates, orjson's 255-level limit) fails on less."""

from __future__ import annotations

import asyncio
import re
from itertools import accumulate
from typing import Any

from litestar import Request
from litestar.types import Empty

from gateway.errors import InvalidRequest

MAX_JSON_DEPTH = 128
_INLINE_BYTES = 65_536  # bodies above this are scanned off the event loop
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_STRING_OR_BRACKET = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text nests deeper than ``limit``, without decoding it (strings are skipped,
    so brackets inside them do not count)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def deep_field(body: bytes, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The top-level field whose value nests too deep (the last string seen at depth 1 before the
    value opened is its key), for the error's ``param``."""
    depth, key = 0, None
    for match in _STRING_OR_BRACKET.finditer(body):
        token = match.group()
        if token[0] == ord('"'):
            if depth == 1:
                key = token
        else:
            depth += _STEP[token[0]]
            if depth > limit:
                break
    try:
        return key[1:-1].decode() if key is not None else None
    except UnicodeDecodeError:
        return None


def check_depth(body: bytes) -> None:
    if too_deep(body):
        field = deep_field(body)
        raise InvalidRequest(
            f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep" + (f" (in `{field}`)" if field else ""), param=field
        )


class GatewayRequest(Request):
    """Litestar's request, with the body's nesting depth checked before it is decoded."""

    async def json(self) -> Any:
        if self._json is Empty and self._connection_state.json is Empty:
            body = await self.body()
            if len(body) > _INLINE_BYTES:
                await asyncio.to_thread(check_depth, body)
            else:
                check_depth(body)
        return await super().json()
