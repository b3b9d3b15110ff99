"""Request bodies are checked for nesting depth before they are decoded: JSON nested thousands of
levels deep (even in a field nobody reads) made the decoder raise RecursionError, a 500, and
anything that walks a decoded value (schemas, templates, orjson's 255-level limit) fails on less.

And their types are checked strictly: Litestar converts a body to its Struct laxly (msgspec's
``strict=False``, so ``"max_tokens": "5"`` became 5), where OpenAI's and Anthropic's APIs answer 400
for a number sent as a string."""

from __future__ import annotations

import asyncio
import re
from itertools import accumulate
from typing import Any

import msgspec
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
            f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep"
            + (f" (in `{field}`)" if field else ""),
            param=field,
        )


_LOCATION = re.compile(r"^(.*) - at `\$\.?(.*)`$")


def check_strict(value: Any, model: type) -> None:
    """A 400 naming the field if ``value`` fits ``model`` only when converted laxly (a number or a
    boolean sent as a string); anything that does not fit at all is left to Litestar's own error."""
    try:
        msgspec.convert(value, model, strict=True, str_keys=True)
    except msgspec.ValidationError as strict_error:
        try:
            msgspec.convert(value, model, strict=False, str_keys=True)
        except msgspec.ValidationError:
            return
        found = _LOCATION.match(str(strict_error))
        problem, field = (found.group(1), found.group(2)) if found else (str(strict_error), None)
        raise InvalidRequest(
            f"invalid type for `{field}`: {problem}" if field else f"invalid request body: {problem}", param=field
        ) from None


class GatewayRequest(Request):
    """Litestar's request, with the body's nesting depth checked before it is decoded and its types
    checked strictly after."""

    async def json(self) -> Any:
        if self._json is not Empty or self._connection_state.json is not Empty:
            return await super().json()
        body = await self.body()
        if len(body) > _INLINE_BYTES:
            await asyncio.to_thread(check_depth, body)
        else:
            check_depth(body)
        value = await super().json()
        data = self.route_handler.parsed_fn_signature.parameters.get("data")
        if data is not None and isinstance(data.annotation, type) and issubclass(data.annotation, msgspec.Struct):
            if len(body) > _INLINE_BYTES:
                await asyncio.to_thread(check_strict, value, data.annotation)
            else:
                check_strict(value, data.annotation)
            fields = getattr(self.app.state, "fields", None)
            if fields is not None:
                fields.check(value, data.annotation, self.url.path)
        return value
