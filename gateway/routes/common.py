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

from gateway.errors import ClientGone, GatewayError, NotFound, Overloaded
from gateway.generation import Generator, TextDelta, now_s
from gateway.schemas import SamplingFields
from gateway.streaming import SSE_HEADERS, sse_events

T = TypeVar("T")


async def respond(
    request: Request, generator: Generator, req: SamplingFields, news: list[NewRequest], stops: list[str], id_prefix: str,
    chunks: Callable[..., AsyncIterator[dict]], body: Callable[[Generator, str, list[TextDelta], SamplingFields], dict],
) -> Response:
    """Admit the generations (a 429 comes now, before any response starts), then stream them as SSE
    built from ``chunks`` or answer whole with ``body``. ``news`` holds one generation per choice
    (``n`` per prompt), choice i being ``news[i]``."""
    slots = []
    try:
        for _ in news:
            slots.append(await generator.admission.acquire())
    except Overloaded:
        for slot in slots:
            slot.release()
        raise
    completion_id = f"{id_prefix}-{uuid.uuid4().hex}"
    skip = req.skip_special_tokens
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        deltas = _merged(generator, news, slots, stops, skip)
        events = sse_events(chunks(generator, deltas, completion_id, include_usage, len(news), req))
        return Stream(events, media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": news[0].request_id})
    work = asyncio.gather(*(generator.complete(new, slot, stops, skip) for new, slot in zip(news, slots)))
    results = await unless_disconnected(request, work)
    return json_response(body(generator, completion_id, list(results), req), news[0].request_id)


async def _merged(
    generator: Generator, news: list[NewRequest], slots: list, stops: list[str], skip: bool
) -> AsyncIterator[tuple[int, TextDelta]]:
    """The deltas of several generations as (choice index, delta), in arrival order."""
    if len(news) == 1:
        async for delta in generator.stream(news[0], slots[0], stops, skip):
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            async for delta in generator.stream(news[index], slots[index], stops, skip):
                queue.put_nowait((index, delta))
        except GatewayError as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(news))]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, GatewayError):
                raise item
            else:
                yield index, item
    finally:  # the client left or one choice failed: stop the others (which aborts them on the worker)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` (a non-streamed generation) but cancel it, which aborts it on the worker, as
    soon as the client hangs up; streams get this from Litestar, plain responses need it here."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            gone = True
            task.cancel()  # only a request: wait until it took effect, and retrieve its outcome
            await asyncio.gather(task, return_exceptions=True)
    if gone:
        raise ClientGone("the client closed the connection; the request was aborted")
    return task.result()


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise NotFound(f"the model `{requested}` does not exist; this server serves `{served}`", param="model", code="model_not_found")


class Chunks:
    """The envelope of one streamed completion's chunks: one id and creation time throughout,
    ``usage: null`` on every chunk when usage was asked for, and a last chunk that carries it."""

    def __init__(self, generator: Generator, completion_id: str, object_name: str, include_usage: bool) -> None:
        self.base = {"id": completion_id, "object": object_name, "created": now_s(), "model": generator.model_name}
        self.include_usage = include_usage
        self.last: dict[int, TextDelta] = {}  # each choice's latest delta, for the usage chunk

    def __call__(self, choice: dict) -> dict:
        body = {**self.base, "choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, choices: int, n: int) -> dict | None:
        """The closing usage chunk, when it was asked for and every choice reported."""
        if not self.include_usage or len(self.last) != choices:
            return None
        return {**self.base, "choices": [], "usage": usage([self.last[i] for i in range(choices)], n)}


def usage(finals: list[TextDelta], n: int = 1) -> dict:
    """Usage of all choices; each prompt counts once however many choices (``n``) it had."""
    prompts = finals[::n]
    prompt_tokens = sum(d.prompt_tokens for d in prompts)
    completion_tokens = sum(d.completion_tokens for d in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(d.cached_tokens for d in prompts)},
    }


def json_response(payload: dict, request_id: str | None = None) -> Response:
    """A JSON response, with the request's id as X-Request-Id when there is one."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(content=orjson.dumps(payload), media_type="application/json", headers=headers)
