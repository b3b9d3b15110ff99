"""Pieces the OpenAI routes share: model check, usage block, JSON responses."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import orjson
from litestar import Request, Response
from litestar.response import Stream

from common.protocol import NewRequest

from gateway.errors import ClientGone, NotFound
from gateway.generation import Generator, TextDelta
from gateway.schemas import SamplingFields
from gateway.streaming import SSE_HEADERS, sse_events

T = TypeVar("T")


async def respond(
    request: Request, generator: Generator, req: SamplingFields, new: NewRequest, stops: list[str], id_prefix: str,
    chunks: Callable[..., AsyncIterator[dict]], body: Callable[[Generator, str, TextDelta], dict],
) -> Response:
    """Admit the request (a 429 comes now, before any response starts), then stream it as SSE built
    from ``chunks`` or answer it whole with ``body``."""
    slot = await generator.admission.acquire()
    completion_id = f"{id_prefix}-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = sse_events(chunks(generator, new, slot, stops, completion_id, include_usage, req.skip_special_tokens))
        return Stream(events, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": new.request_id})
    result = await unless_disconnected(request, generator.complete(new, slot, stops, req.skip_special_tokens))
    return json_response(body(generator, completion_id, result), new.request_id)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` (a non-streamed generation) but cancel it, which aborts it on the worker, as
    soon as the client hangs up; streams get this from Litestar, plain responses need it here."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise ClientGone("the client closed the connection; the request was aborted")
    return task.result()


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise NotFound(f"the model `{requested}` does not exist; this server serves `{served}`", param="model", code="model_not_found")


def usage(delta: TextDelta) -> dict:
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens},
    }


def json_response(payload: dict, request_id: str | None = None) -> Response:
    """A JSON response, with the request's id as X-Request-Id when there is one."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(content=orjson.dumps(payload), media_type="application/json", headers=headers)
