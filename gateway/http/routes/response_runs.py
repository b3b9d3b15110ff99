"""Stored Responses: what a response keeps (its record), runs whose events are logged, and the
streams that resume on any gateway (``GET /v1/responses/{id}?stream=true&starting_after=N``),
taking the generation over when the gateway that ran it died.

A takeover replays the token chunks the dead gateway logged through the same pipeline (detokenizer,
stop strings, tool-call parser, the output builder), which gives back the same events with the same
sequence numbers; those already in the log are skipped, and the worker continues after the
delivered tokens, as a dead worker's requests do. Greedy output is the same as an uninterrupted run.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.connection import ASGIConnection
from litestar.response import Stream

from common.protocol import RequestOutput
from gateway.errors import InvalidRequest, not_stored
from gateway.http.streaming import SSE_HEADERS
from gateway.schemas.responses import FunctionCallItem, InputItem, OutputMessage, ResponseObject, ResponsesRequest
from gateway.state.records import ResponseRecord
from gateway.state.runs import FRAME, STREAM_END, Event, Run
from gateway.state.service import StateService

log = logging.getLogger(__name__)

POLL_S = 0.05  # how often a stream followed through another gateway reads the log
_chunk_encoder = msgspec.msgpack.Encoder()


class EventType(msgspec.Struct):
    type: str


def output_messages(output: list) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue its conversation (its thinking left
    out, as reasoning models' templates leave out earlier turns' thinking)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if isinstance(item, OutputMessage):
            message["content"] += "".join(part.text for part in item.content)
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            message.setdefault("tool_calls", []).append(call)
    return [message]


_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(items: str | list[InputItem]) -> list[dict]:
    """The request's input as items with ids, as ``input_items`` lists them."""
    if isinstance(items, str):
        items = [InputItem(role="user", content=items)]
    out = []
    for item in items:
        entry = {k: v for k, v in msgspec.to_builtins(item).items() if v is not None}
        entry.setdefault("type", "message")
        entry.setdefault("id", f"{_PREFIXES.get(entry['type'], 'item')}_{uuid.uuid4().hex}")
        if entry["type"] == "message":
            if isinstance(entry.get("content"), str):
                kind = "output_text" if entry.get("role") == "assistant" else "input_text"
                entry["content"] = [{"type": kind, "text": entry["content"]}]
            entry.setdefault("status", "completed")
        out.append(entry)
    return out


@dataclass(slots=True)
class Turn:
    """What a response stores besides its body: whose it is and what this turn brought."""

    owner: str
    items: bytes  # its input items (JSON)
    messages: list[dict]  # its input as chat messages (its output joins them when it ends)
    request: ResponsesRequest
    prompt: list[int]
    conversation: str | None = None

    async def after(self, state: StateService, response: ResponseObject) -> None:
        """Once it is stored: its key's byte budget, and a response in a conversation adds its input
        and output items to it."""
        if response.store:
            state.store.fit_owner_soon(self.owner, response.id)
        if self.conversation is not None and response.status in ("completed", "incomplete"):
            items = msgspec.json.decode(self.items) + [msgspec.to_builtins(item) for item in response.output]
            await state.store.conversations.add(self.conversation, self.owner, items)

    def size(self, response: ResponseObject) -> int:
        """The bytes it stores before any output: the budget is checked on this."""
        return len(self.items) + len(msgspec.json.encode(self.messages)) + len(msgspec.json.encode(response))

    def record(self, response: ResponseObject, status: str | None = None) -> ResponseRecord:
        if status == "cancelled":
            response.status = "cancelled"
        usage = response.usage
        return ResponseRecord(
            id=response.id,
            owner=self.owner,
            created_at=response.created_at,
            model=response.model,
            status=response.status,
            body=msgspec.json.encode(response),
            input_items=self.items,
            messages=msgspec.json.encode(
                self.messages + (output_messages(response.output) if response.status != "in_progress" else [])
            ),
            previous_id=response.previous_response_id,
            conversation_id=self.conversation,
            background=response.background,
            input_tokens=usage.input_tokens if usage else 0,
            cached_tokens=usage.input_tokens_details.cached_tokens if usage else 0,
            output_tokens=usage.output_tokens if usage else 0,
            reasoning_tokens=usage.output_tokens_details.reasoning_tokens if usage else 0,
        )

    def takeover_blob(self) -> bytes:
        return msgspec.json.encode(
            {
                "request": self.request,
                "prompt": self.prompt,
                "messages": self.messages,
                "conversation": self.conversation,
            }
        )


def start_run(
    state: StateService, response: ResponseObject, turn: Turn, source_of, resumed: list[Event] | None = None
) -> Run:
    """Run a streamed or background response here, its events and token chunks logged as they go.
    ``source_of(run)`` gives its events (the run hands the generation its chunk hook)."""
    run = Run(
        response.id,
        response.background,
        state.store.writer,
        lambda status: turn.record(response, status),
        resumed,
        lambda: turn.after(state, response),
    )
    if resumed is None:
        start = turn.record(response)
        start.request, start.gateway = turn.takeover_blob(), state.store.gateway_id
        state.store.writer.started(start)
    return state.runs.start(run, source_of(run))


def chunk_hook(run: Run, already: int = 0):  # the generation's on_output
    counter = iter(range(already, 1 << 62))

    def on_output(output: RequestOutput) -> None:
        run.chunk(next(counter), _chunk_encoder.encode(output))

    return on_output


def sse_stream(events: AsyncIterator[bytes], request_id: str | None = None) -> Stream:
    headers = {**SSE_HEADERS, **({"X-Request-Id": request_id} if request_id else {})}
    return Stream(events, media_type="text/event-stream", headers=headers)


async def followed(run: Run, after: int = -1, cancel_on_exit: bool = False) -> AsyncIterator[Event]:
    """A run's events; a plain stream's run ends when its client leaves."""
    try:
        async for event in run.follow(after):
            yield event
    finally:
        if cancel_on_exit and not run.done and run.task is not None:
            run.task.cancel()


async def with_ids(events: AsyncIterator[Event], stream: str) -> AsyncIterator[bytes]:
    """Events as SSE, each with its ``id:``."""
    async for event in events:
        yield event.sse(stream)


def logged_event(seq: int, data: bytes) -> Event:
    """An event as the store's log holds it: a Responses event's JSON, or another dialect's frame."""
    if not data:
        return Event(STREAM_END, seq, data)
    if data[:1] == b'"':
        return Event(FRAME, seq, data)
    return Event(msgspec.json.decode(data, type=EventType).type, seq, data)


def last_event(connection: ASGIConnection) -> tuple[str, int] | None:
    """The stream and event number a reconnecting client names in ``Last-Event-ID`` (``<id>/<n>``, as
    each event's ``id:`` says), or None without one."""
    value = connection.headers.get("last-event-id")
    if not value:
        return None
    stream, _, seq = value.strip().rpartition("/")
    if not stream or not seq.lstrip("-").isdigit():
        raise InvalidRequest(
            f"`Last-Event-ID` must be an event id this server sent (<stream id>/<number>); got {value!r}",
            param="Last-Event-ID",
        )
    return stream, int(seq)


async def follow(state: StateService, response_id: str, owner: str, after: int) -> AsyncIterator[bytes]:
    """Events above ``after``, from wherever the stream runs: here (memory), on another gateway
    (its log, read every POLL_S), or nowhere because its gateway died (then it is taken over here)."""
    last = after
    while True:
        run = state.runs.get(response_id)
        if run is not None:
            async for event in run.follow(last):
                yield event.sse(response_id)
            return
        row = await state.store.get(response_id, owner)
        if row is None:
            return  # deleted meanwhile
        for seq, data in await state.store.events_after(response_id, last):
            yield logged_event(seq, data).sse(response_id)
            last = seq
        if not row.running:
            for seq, data in await state.store.events_after(response_id, last):
                yield logged_event(seq, data).sse(response_id)
            return
        if not await state.leases.alive(row.gateway) and state.take_over is not None:
            await state.take_over(response_id, row.gateway or "")  # responses.take_over
            continue
        await asyncio.sleep(POLL_S)


async def resume_stream(connection: ASGIConnection, state: StateService, owner: str) -> Stream | None:
    """The answer to a request that names the last event its client saw (``Last-Event-ID``): the
    rest of that stream, from wherever it runs; None when the request names none."""
    named = last_event(connection)
    if named is None:
        return None
    stream_id, after = named
    if await state.store.get(stream_id, owner) is None:
        raise not_stored("stream", stream_id, "Last-Event-ID")
    return sse_stream(follow(state, stream_id, owner, after))
