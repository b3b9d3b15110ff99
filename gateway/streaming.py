"""Server-sent events exactly as OpenAI frames them: ``data: <json>\\n\\n`` blocks, then ``data: [DONE]``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import orjson

from gateway.errors import GatewayError

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def sse_events(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Frame chunks as events; an error after the stream started becomes a last ``error`` event."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except GatewayError as exc:
        log.warning("stream ended with an error: %s", exc.message)
        yield sse(exc.body())
        return
    yield DONE
