"""Chat completions, completions and Messages streams that survive their gateway, as Responses
streams do (``response_runs.py``): the same event log, token chunks and takeover.

Each event of such a stream carries ``id: <stream id>/<n>``, the stream id being the chunks' ``id``
(``chatcmpl-...``, ``cmpl-...``) or the message's (``msg_...``). A client whose connection broke
sends the same request again, to any gateway, with the header ``Last-Event-ID`` naming the last
event it got; it gets the events after it: from this gateway's memory, from the log another gateway
writes, or, when the stream's gateway died, from a takeover here that replays the logged chunks
through the same pipeline and lets a worker continue after them (greedy output is the same as an
uninterrupted run's). The stream is a row of the responses table (not a response: the Responses
routes do not show it), kept as long as stored responses are.

A stream is logged unless its request says ``store: false``, or it has several choices or prompts
(a takeover replays one). Its client leaving ends it, as before.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.connection import ASGIConnection
from litestar.response import Stream

from common.protocol import RequestOutput
from gateway.generate import core
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest
from gateway.generate.served_model import now_s
from gateway.http.routes.response_runs import chunk_hook, followed, resume_stream, sse_stream, with_ids
from gateway.http.streaming import sse_events
from gateway.policy.caller import Caller
from gateway.state.records import ResponseRecord
from gateway.state.runs import FRAME, STREAM_END, Event, Run
from gateway.state.service import StateService

_encode_str = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class StreamId:
    """A stream's id and its ``created`` time: what its every chunk says, before and after a takeover."""

    id: str
    created: int

    @classmethod
    def new(cls, prefix: str) -> StreamId:
        import uuid

        return cls(f"{prefix}{uuid.uuid4().hex}", now_s())


@dataclass(frozen=True, slots=True)
class Dialect:
    """What a takeover needs of a dialect: its body type, its core request, and its stream's chunks."""

    body: type
    core_request: Callable[[Any], CoreRequest]
    chunks: Callable[[core.Generation, Any, StreamId], AsyncIterator[Any]]
    prefix: str  # of its stream ids: chatcmpl-, cmpl-, msg_
    named: bool = False  # events named after their type (Messages), and no [DONE]


DIALECTS: dict[str, Dialect] = {}  # by name; each route module adds its own


async def start_stream(
    request: ASGIConnection,
    name: str,
    data: Any,
    req: CoreRequest,
    models: ModelRegistry,
    caller: Caller,
    state: StateService,
) -> Stream | tuple[core.Generation, StreamId]:
    """The opening the logged dialects share: for a reconnecting client, the rest of its stream;
    otherwise the generation started, and a stream it may log answered at once, logged."""
    if (resumed := await resume_stream(request, state, caller.owner)) is not None:
        return resumed
    generation = await core.start(models.get(data.model), req, caller)
    ident = StreamId.new(DIALECTS[name].prefix)
    if data.stream and data.store is not False and len(generation.news) == 1:  # one prompt, one choice
        stream = logged_stream(state, caller.owner, name, generation, data, ident)
        await state.store.writer.sync()  # its row committed before an id goes out: any gateway can resume it
        return stream
    return generation, ident


async def _frames(chunks: AsyncIterator[Any], named: bool) -> AsyncIterator[Event]:
    seq = 0
    async for frame in sse_events(chunks, named):
        yield Event(FRAME, seq, _encode_str(frame.decode()))
        seq += 1
    yield Event(STREAM_END, seq, b"")


def _run(state: StateService, record: ResponseRecord, logged: list[Event] | None = None) -> Run:
    def finish(status: str) -> ResponseRecord:
        record.status, record.request = "completed", None
        return record

    return Run(record.id, False, state.store.writer, finish, logged)


def _source(run: Run, dialect: Dialect, generation: core.Generation, data: Any, ident: StreamId):
    generation.req.on_output = chunk_hook(run, len(generation.req.replay))
    return _frames(dialect.chunks(generation, data, ident), dialect.named)


def logged_stream(
    state: StateService, owner: str, name: str, generation: core.Generation, data: Any, ident: StreamId
) -> Stream:
    """Start a stream whose events and chunks are logged, and answer with its events."""
    dialect = DIALECTS[name]
    blob = {"dialect": name, "body": data, "prompt": generation.prompts[0], "created": ident.created}
    record = ResponseRecord(
        id=ident.id,
        owner=owner,
        created_at=ident.created,
        model=generation.served.served_name,
        status="in_progress",
        body=b"{}",
        input_items=b"[]",
        messages=b"[]",
        request=msgspec.json.encode(blob),
        gateway=state.store.gateway_id,
    )
    state.store.writer.started(record)
    run = _run(state, record)
    state.runs.start(run, _source(run, dialect, generation, data, ident))
    return sse_stream(with_ids(followed(run, cancel_on_exit=True), ident.id), generation.request_id)


async def resume(
    state: StateService,
    models: ModelRegistry,
    stream_id: str,
    owner: str,
    blob: dict,
    chunks: list[RequestOutput],
    logged: list[Event],
) -> None:
    """Run on here a stream a dead gateway was running (``responses.take_over`` found it is not a response)."""
    dialect = DIALECTS[blob["dialect"]]
    data = msgspec.convert(blob["body"], dialect.body)
    greq = dialect.core_request(data)
    greq.messages, greq.prompts = None, [blob["prompt"]]
    greq.replay, greq.owner, greq.meter = chunks, owner, state.usage
    generation = await core.start(models.get(data.model), greq)
    row = await state.store.db.fetchone("SELECT model FROM responses WHERE id = ?", stream_id)
    record = ResponseRecord(
        id=stream_id,
        owner=owner,
        created_at=blob["created"],
        model=row[0] if row else data.model,
        status="in_progress",
        body=b"{}",
        input_items=b"[]",
        messages=b"[]",
    )
    run = _run(state, record, logged)
    state.runs.start(run, _source(run, dialect, generation, data, StreamId(stream_id, blob["created"])))
