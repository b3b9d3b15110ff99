"""Server-sent events: OpenAI's chat and completions frame ``data: <json>\\n\\n`` blocks and end with
``data: [DONE]``; the Responses and Messages APIs name each event (``event: <type>``) after the
payload's ``type`` and send no [DONE]."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse(payload: Any, event: str | None = None) -> bytes:
    """One event; ``payload`` is a dict or a msgspec Struct."""
    data = b"data: " + _encoder.encode(payload) + b"\n\n"
    return b"event: " + event.encode() + b"\n" + data if event else data


def event_type(payload: Any) -> str:
    return payload["type"] if isinstance(payload, dict) else payload.type


async def sse_events(chunks: AsyncIterator[Any], named: bool = False, stream_id: str = "") -> AsyncIterator[bytes]:
    """Frame chunks as events (``named``: with their type as the event name, and no [DONE]); an
    error after the stream started becomes a last ``error`` event, unless the dialect made its own.
    With a ``stream_id``, each event has ``id: <stream_id>/<n>`` (what ``Last-Event-ID`` names)."""
    ids = iter(range(1 << 62))

    def framed(frame: bytes) -> bytes:
        return b"id: %s/%d\n%s" % (stream_id.encode(), next(ids), frame) if stream_id else frame

    try:
        async for chunk in chunks:
            yield framed(sse(chunk, event_type(chunk) if named else None))
    except GatewayError as exc:
        log.warning("stream ended with an error: %s", exc.message)
        yield framed(sse(exc.body(), "error" if named else None))
        return
    if not named:
        yield framed(DONE)
