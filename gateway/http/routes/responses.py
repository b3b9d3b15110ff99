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
``prompt``, built-in tools (anything but ``function`` in ``tools``), image and file inputs,
``item_reference`` items.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Litestar, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from common.protocol import RequestOutput
from gateway.errors import InvalidRequest, not_stored
from gateway.generate import core
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.served_model import ServedModel
from gateway.http.auth import caller_owner
from gateway.http.routes.common import RESPONSE, documented, json_response
from gateway.http.routes.conversations import conversation_id
from gateway.http.routes.response_output import Output
from gateway.http.routes.response_runs import (
    EventType,
    Turn,
    chunk_hook,
    follow,
    framed,
    input_items,
    sse_stream,
    start_run,
)
from gateway.http.routes.responses_input import core_request, input_messages, refuse_unsupported
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
from gateway.state.limits import check_budget
from gateway.state.runs import Event
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
        data: JSONBody[ResponsesRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
        stored: NamedDependency[StateService],
    ) -> Response:
        req, state, owner = data, stored, caller.owner
        served = models.get(req.model)
        refuse_unsupported(req)
        conversation = conversation_id(req.conversation)
        history = await _history(state, req, conversation, owner)
        turn_messages = input_messages(req.input, history)
        greq = core_request(req, history + turn_messages)
        response = _envelope(served, req)
        response.conversation = {"id": conversation} if conversation else None
        turn = Turn(owner, msgspec.json.encode(input_items(req.input)), turn_messages, req, [], conversation)
        if req.store:
            check_budget(turn.size(response), state.store.limits.max_response_bytes)
        generation = await core.start(served, greq, caller)
        turn.prompt = generation.prompts[0]  # what a gateway taking it over runs again
        builder = Output(served, response, req.top_logprobs is not None)
        if req.store and (req.stream or req.background):
            run = start_run(state, response, turn, lambda run: _logged(builder, generation, run))
            if req.background:  # its row is committed before its id goes out: any gateway can be asked about it
                await state.store.writer.sync()
            if req.stream:
                return sse_stream(framed(run, cancel_on_exit=not req.background), generation.request_id)
            return json_response(response, generation.request_id)
        if req.stream:
            return sse_stream(_framed(builder.stream(generation)), generation.request_id)
        async for _ in builder.events(generation, await generation.collect(caller)):
            pass
        if req.store:
            try:
                await state.store.writer.final(turn.record(response))
            except Exception as exc:  # the answer is good: give it, and say why it is not stored
                log.error("response %s could not be stored: %s", response.id, exc)
        await turn.after(state, response)
        return json_response(response, generation.request_id)

    @get(
        ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"],
        responses=documented(ResponseObject, "a stored response"),
    )
    async def retrieve(
        self,
        request: Request,
        response_id: FromPath[str],
        stream: FromQuery[bool] = False,
        starting_after: FromQuery[int] = -1,
    ) -> Response:
        found = await _stored(request, response_id)
        if stream:
            if not found.background and not found.running and starting_after < 0:
                raise InvalidRequest("only background responses can be streamed again once they ended", param="stream")
            return sse_stream(follow(request.app, response_id, caller_owner(request), starting_after))
        return Response(content=found.body, media_type="application/json")

    @delete(
        ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"],
        status_code=200,
        responses=documented(DeletedResponse, "the response is forgotten"),
    )
    async def remove(self, request: Request, response_id: FromPath[str]) -> Response:
        state: StateService = request.app.state.state
        state.runs.cancel(response_id, requested=False)
        RESPONSE.found(await state.store.delete(response_id, caller_owner(request)), response_id)
        return json_response(DeletedResponse(response_id))


async def _stored(request: Request, response_id: str):  # a StoredResponse
    """The caller's stored response: another key's is a 404, as an absent one."""
    found = RESPONSE.found(await request.app.state.state.store.get(response_id, caller_owner(request)), response_id)
    return found


async def _history(
    state: StateService, req: ResponsesRequest, conversation: str | None, owner: str
) -> list[dict[str, Any]]:
    """The chat messages before this turn: the previous response's conversation, or the
    conversation's items (another key's are as absent)."""
    if req.previous_response_id is not None:
        previous = await state.store.get(req.previous_response_id, owner)
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


async def _framed(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    async for event in events:
        yield event.sse()


async def resume(
    app: Litestar, response: ResponseObject, turn: Turn, chunks: list[RequestOutput], logged: list[Event]
) -> None:
    """Run on here a response a dead gateway was running (``response_runs.take_over``): its prompt
    as the token ids it ran, its logged chunks replayed before the worker continues."""
    state: StateService = app.state.state
    req = turn.request
    served = app.state.models.get(req.model)
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


async def take_over(app: Litestar, response_id: str, dead_gateway: str) -> bool:
    """Continue here a response whose gateway died: claim it (one gateway wins), replay its logged
    chunks, and run it on. False when another gateway claimed it first, or it cannot run here."""
    state: StateService = app.state.state
    row = await state.store.db.fetchone(
        "SELECT owner, body, input_items, request, background FROM responses WHERE id = ?", response_id
    )
    if row is None or row[3] is None or not await state.leases.claim(response_id, dead_gateway):
        return False
    blob = msgspec.json.decode(row[3])
    req = msgspec.convert(blob["request"], ResponsesRequest)
    response = msgspec.json.decode(row[1], type=ResponseObject)
    turn = Turn(row[0], bytes(row[2]), blob["messages"], req, blob["prompt"], blob.get("conversation"))
    chunks = [msgspec.msgpack.decode(c, type=RequestOutput) for c in await state.store.chunks(response_id)]
    logged = [
        Event(msgspec.json.decode(d, type=EventType).type, seq, d)
        for seq, d in await state.store.events_after(response_id, -1)
    ]
    log.warning(
        "taking over response %s from gateway %s (dead): %d events and %d chunks logged",
        response_id,
        dead_gateway,
        len(logged),
        len(chunks),
    )
    try:
        await resume(app, response, turn, chunks, logged)
    except Exception as exc:
        log.error("response %s could not be taken over: %s", response_id, exc)
        response.status = "failed"
        await state.store.writer.final(turn.record(response))
        return False
    return True
