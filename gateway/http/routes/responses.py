"""POST /v1/responses (and /responses), GET and DELETE /v1/responses/{id}: OpenAI's Responses API
over the generation core, its responses kept in the state store (``gateway.state``), scoped to the
key that made them.

The input (a string, or message / function_call / function_call_output items, after any stored
``previous_response_id`` conversation or ``conversation``'s items) becomes chat messages, rendered by
the chat template as chat completions are; ``instructions`` go first as a system message and, as with
OpenAI, are not carried to a continuation. The output is a ``message`` item with ``output_text`` and
a ``function_call`` item per call (``response_output.py``). Streamed, it is OpenAI's typed events in
order, each with an increasing ``sequence_number``. A stored response that streams or runs in the
``background`` logs its events as it goes, so it can be followed again (``?stream=true``) on any
gateway and taken over when its own gateway dies (``response_runs.py``).

A reasoning model's thinking is a ``reasoning`` item before the message (``reasoning_text``
content, streamed as ``response.reasoning_text.delta``), counted in ``reasoning_tokens``;
``reasoning.effort`` bounds it. Accepted and ignored: ``reasoning.summary``, ``truncation`` (always ``disabled``: a prompt too long is a 400), ``include``,
``max_tool_calls``, ``service_tier``, ``prompt_cache_key``. Refused with a 400 naming the field:
``prompt``, built-in tools (anything but ``function`` in ``tools``), ``input_file`` parts,
``item_reference`` items. ``input_image`` parts (``image_url``, or ``file_id`` from the Files API) go to an
image-text model (gateway/generate/vision.py).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from common.protocol import RequestOutput
from gateway.errors import InvalidRequest, not_stored
from gateway.generate import core
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.served_model import ServedModel
from gateway.http.auth import caller_owner
from gateway.http.routes import stream_runs
from gateway.http.routes.common import RESPONSE, StateStore, documented, json_response
from gateway.http.routes.conversations import conversation_id
from gateway.http.routes.response_output import Output
from gateway.http.routes.response_runs import (
    Turn,
    chunk_hook,
    follow,
    followed,
    input_items,
    last_event,
    logged_event,
    output_messages,
    resume_stream,
    sse_stream,
    start_run,
    with_ids,
)
from gateway.http.routes.responses_input import core_request, inline_files, input_messages, refuse_unsupported
from gateway.policy.caller import Caller
from gateway.schemas.chat import echoed_tier
from gateway.schemas.responses import (
    DeletedResponse,
    InputItem,
    Reasoning,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
)
from gateway.state.files import Files
from gateway.state.limits import check_budget
from gateway.state.runs import Event, Run
from gateway.state.service import StateService

log = logging.getLogger(__name__)


class ResponsesController(Controller):
    path = "/"

    @post(
        ["/v1/responses", "/responses"],
        status_code=200,
        responses=documented(ResponseObject, "the response (with `stream`: typed events)"),
    )
    async def create(
        self,
        request: Request,
        stored: StateStore,
        data: JSONBody[ResponsesRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
        files: NamedDependency[Files | None],
    ) -> Response:
        req, state = data, stored
        if (resumed := await resume_stream(request, state, caller.owner)) is not None:  # a client reconnecting
            return resumed
        started = await start_response(req, models.get(req.model), caller, state, files)
        response, generation = started.response, started.generation
        if req.stream:
            return sse_stream(with_ids(started.events(), response.id), generation.request_id)
        if started.run is not None:  # background
            return json_response(response, generation.request_id)
        async for _ in started.builder.events(generation, await generation.collect(caller)):
            pass
        if req.store:
            try:
                await state.store.writer.final(started.turn.record(response))
            except Exception as exc:  # the answer is good: give it, and say why it is not stored
                log.error("response %s could not be stored: %s", response.id, exc)
        await started.turn.after(state, response)
        return json_response(response, generation.request_id)

    @get(
        ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"],
        responses=documented(ResponseObject, "a stored response"),
    )
    async def retrieve(
        self,
        request: Request,
        stored: StateStore,
        response_id: FromPath[str],
        stream: FromQuery[bool] = False,
        starting_after: FromQuery[int] = -1,
    ) -> Response:
        found = await _stored(request, stored, response_id)
        if stream:
            if not found.background and not found.running and starting_after < 0 and last_event(request) is None:
                raise InvalidRequest("only background responses can be streamed again once they ended", param="stream")
            named = last_event(request)  # EventSource reconnects with the last id it saw
            after = named[1] if named is not None and named[0] == response_id else starting_after
            return sse_stream(follow(stored, response_id, caller_owner(request), after))
        return Response(content=found.body, media_type="application/json")

    @delete(
        ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"],
        status_code=200,
        responses=documented(DeletedResponse, "the response is forgotten"),
    )
    async def remove(self, request: Request, stored: StateStore, response_id: FromPath[str]) -> Response:
        state = stored
        if not response_id.startswith("resp_"):  # another dialect's stream (stream_runs.py) is not a response
            raise not_stored("response", response_id, "response_id")
        state.runs.cancel(response_id, requested=False)
        RESPONSE.found(await state.store.delete(response_id, caller_owner(request)), response_id)
        return json_response(DeletedResponse(response_id))


async def _stored(request: Request, state: StateService, response_id: str):  # a StoredResponse
    """The caller's stored response: another key's is a 404, as an absent one."""
    found = await state.store.get(response_id, caller_owner(request)) if response_id.startswith("resp_") else None
    return RESPONSE.found(found, response_id)  # another dialect's stream (stream_runs.py) is not a response


async def _history(
    state: StateService, req: ResponsesRequest, conversation: str | None, owner: str
) -> list[dict[str, Any]]:
    """The chat messages before this turn: the previous response's conversation, or the
    conversation's items (another key's are as absent)."""
    if req.previous_response_id is not None:
        previous = (
            await state.store.get(req.previous_response_id, owner)
            if req.previous_response_id.startswith("resp_")
            else None
        )
        if previous is None or previous.running:
            what = "not found" if previous is None else "still in progress"
            raise InvalidRequest(
                f"Previous response with id {req.previous_response_id!r} {what}",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return await state.store.history(req.previous_response_id, owner)
    if conversation is None:
        return []
    items = await state.store.conversations.items(conversation, owner)
    if items is None:
        raise not_stored("conversation", conversation, "conversation", "conversation_not_found")
    usable = [
        msgspec.convert(item, InputItem)
        for item in items
        if item.get("type") in ("message", "function_call", "function_call_output")
    ]
    return input_messages(usable) if usable else []


async def _logged(builder: Output, generation: core.Generation, run) -> AsyncIterator[Event]:
    generation.req.on_output = chunk_hook(run, len(generation.req.replay))
    async for event in builder.stream(generation):
        yield event


@dataclass(slots=True)
class Started:
    """A response as it starts: its envelope, what it stores, its generation, and its run when its
    events are logged (stored, and streamed or in the background)."""

    response: ResponseObject
    turn: Turn
    history: list[dict[str, Any]]
    generation: core.Generation
    builder: Output
    run: Run | None

    def events(self) -> AsyncIterator[Event]:
        """Its events as they come; a plain stream ends (and its generation stops) when its reader leaves."""
        if self.run is not None:
            return followed(self.run, cancel_on_exit=not self.response.background)
        return self.builder.stream(self.generation)

    def conversation(self) -> list[dict[str, Any]]:
        """The chat messages that a follow-up continues (a WebSocket keeps them for ``store: false``)."""
        return self.history + self.turn.messages + output_messages(self.response.output)


async def start_response(
    req: ResponsesRequest,
    served: ServedModel,
    caller: Caller,
    state: StateService,
    files: Files | None,
    local: dict[str, list[dict[str, Any]]] | None = None,
) -> Started:
    """Check a request and start its generation (``local``: conversations a WebSocket keeps in
    memory, by response id, found before the store)."""
    refuse_unsupported(req)
    owner = caller.owner
    conversation = conversation_id(req.conversation)
    if local is not None and req.previous_response_id in local:
        history = local[req.previous_response_id]
    else:
        history = await _history(state, req, conversation, owner)
    turn_messages = input_messages(req.input, history)
    await inline_files(turn_messages, files, owner)
    greq = core_request(req, history + turn_messages)
    response = _envelope(served, req)
    response.conversation = {"id": conversation} if conversation else None
    turn = Turn(owner, msgspec.json.encode(input_items(req.input)), turn_messages, req, [], conversation)
    if req.store:
        check_budget(turn.size(response), state.store.limits.max_response_bytes)
    generation = await core.start(served, greq, caller)
    turn.prompt = generation.prompts[0]  # what a gateway taking it over runs again
    builder = Output(served, response, req.top_logprobs is not None)
    run = None
    if req.store and (req.stream or req.background):
        run = start_run(state, response, turn, lambda run: _logged(builder, generation, run))
        # its row is committed before its id goes out: any gateway can be asked about it, or resume it
        await state.store.writer.sync()
    return Started(response, turn, history, generation, builder, run)


async def resume(
    state: StateService,
    models: ModelRegistry,
    response: ResponseObject,
    turn: Turn,
    chunks: list[RequestOutput],
    logged: list[Event],
) -> None:
    """Run on here a response a dead gateway was running (``response_runs.take_over``): its prompt
    as the token ids it ran, its logged chunks replayed before the worker continues."""
    req = turn.request
    served = models.get(req.model)
    greq = core_request(req, [])
    greq.messages, greq.prompts = None, [turn.prompt]
    greq.replay, greq.owner, greq.meter = chunks, turn.owner, state.usage
    generation = await core.start(served, greq)
    builder = Output(served, response, req.top_logprobs is not None)
    start_run(state, response, turn, lambda run: _logged(builder, generation, run), logged)


def _envelope(served: ServedModel, req: ResponsesRequest) -> ResponseObject:
    """The response as it starts: in progress, no output yet, the request's settings echoed."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"  # OpenAI echoes auto, tools or not
    return ResponseObject(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=int(time.time()),
        model=served.served_name,
        status="in_progress",
        output=[],
        usage=None,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tool_choice=choice,
        tools=[t if t.strict is not None else msgspec.structs.replace(t, strict=True) for t in req.tools or []],
        text=req.text or TextConfig(),
        store=req.store,
        instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        previous_response_id=req.previous_response_id,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        metadata=req.metadata or {},
        user=req.user,
        background=bool(req.background),
        reasoning=req.reasoning or Reasoning(),
        service_tier=echoed_tier(req.service_tier),
    )


async def take_over(state: StateService, models: ModelRegistry, response_id: str, dead_gateway: str) -> bool:
    """Continue here a response (or another dialect's stream, ``stream_runs.py``) whose gateway died:
    claim it (one gateway wins), replay its logged chunks, and run it on. False when another gateway
    claimed it first, or it cannot run here."""
    row = await state.store.db.fetchone(
        "SELECT owner, body, input_items, request, background FROM responses WHERE id = ?", response_id
    )
    if row is None or row[3] is None or not await state.leases.claim(response_id, dead_gateway):
        return False
    blob = msgspec.json.decode(row[3])
    chunks = [msgspec.msgpack.decode(c, type=RequestOutput) for c in await state.store.chunks(response_id)]
    logged = [logged_event(seq, d) for seq, d in await state.store.events_after(response_id, -1)]
    log.warning(
        "taking over %s from gateway %s (dead): %d events and %d chunks logged",
        response_id,
        dead_gateway,
        len(logged),
        len(chunks),
    )
    if "dialect" in blob:
        try:
            await stream_runs.resume(state, models, response_id, row[0], blob, chunks, logged)
        except Exception as exc:
            log.error("stream %s could not be taken over: %s", response_id, exc)
            return False
        return True
    req = msgspec.convert(blob["request"], ResponsesRequest)
    response = msgspec.json.decode(row[1], type=ResponseObject)
    turn = Turn(row[0], bytes(row[2]), blob["messages"], req, blob["prompt"], blob.get("conversation"))
    try:
        await resume(state, models, response, turn, chunks, logged)
    except Exception as exc:
        log.error("response %s could not be taken over: %s", response_id, exc)
        response.status = "failed"
        await state.store.writer.final(turn.record(response))
        return False
    return True
