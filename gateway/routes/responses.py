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
from gateway import core
from gateway.auth import caller_owner
from gateway.conversation_checks import ToolCallLedger, json_arguments, not_empty, required_text
from gateway.core import GenerationRequest
from gateway.errors import InvalidRequest, NotFound
from gateway.generation import Generator
from gateway.model_registry import ModelRegistry
from gateway.routes.common import documented, json_response
from gateway.routes.conversations import conversation_id
from gateway.routes.response_output import Output
from gateway.routes.response_runs import (
    Turn,
    chunk_hook,
    follow,
    framed,
    input_items,
    not_stored,
    sse_stream,
    start_run,
)
from gateway.schemas_responses import (
    DeletedResponse,
    InputItem,
    InputPart,
    Reasoning,
    ResponseObject,
    ResponsesRequest,
    TextConfig,
)
from gateway.state.limits import check_budget, check_metadata, check_user
from gateway.state.runs import Event
from gateway.state.service import StateService

log = logging.getLogger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: str | list[InputPart] | None, param: str) -> str:
    """A content field's text: a string, or text parts (anything else is a 400 naming it)."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequest(
                f"`{param}[{j}]` is a {part.type} part; only text is supported here", param=f"{param}[{j}]"
            )
    return "".join(part.text for part in content)  # type: ignore[misc]


def input_messages(items: str | list[InputItem], history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """The input as chat messages: consecutive function calls join one assistant message. A
    ``function_call_output`` must answer a call made earlier (in ``history`` or the input), a
    ``function_call``'s arguments must be JSON, and a message must have content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    calls = ToolCallLedger(history)
    for i, item in enumerate(items):
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(
                    f"`input[{i}].role` must be user, assistant, system or developer; got {item.role!r}",
                    param=f"input[{i}].role",
                )
            if item.role == "user":
                not_empty(item.content, f"input[{i}].content")
            messages.append({"role": item.role, "content": _text(item.content, f"input[{i}].content")})
        elif item.type == "function_call":
            calls.call(item.call_id, f"input[{i}].call_id")
            name = required_text(item.name, f"input[{i}].name")
            arguments = json_arguments(item.arguments, f"input[{i}].arguments")
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            calls.result(item.call_id, f"input[{i}].call_id", "function_call")
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input[{i}].output")}
            )
        elif item.type == "reasoning":
            continue  # another model's reasoning: nothing here reads it
        else:
            raise InvalidRequest(
                f"`input[{i}].type` {item.type!r} is not supported (message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    if not messages:
        raise InvalidRequest("`input` must hold at least one item", param="input")
    return messages


def generation_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> GenerationRequest:
    """The body in the core's terms, ``conversation`` being the chat messages of the history and
    the input; only the Responses dialect's own shapes are checked here (the rest of the body's in
    ``_refuse_unsupported``, before the history is read)."""
    functions = []
    for i, tool in enumerate(
        req.tools or []
    ):  # in chat's shape, without null fields (the template and the Hermes prompt want none)
        if tool.type != "function":
            raise InvalidRequest(
                f"`tools[{i}].type` {tool.type!r} is not supported: only function tools are", param=f"tools[{i}].type"
            )
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        functions.append(
            {"type": "function", "function": {k: v for k, v in function.items() if k != "description" or v is not None}}
        )
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest(
                '`tool_choice` must be none, auto, required or {"type": "function", "name": ...}', param="tool_choice"
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return GenerationRequest(
        sampling=req,
        messages=system + conversation,
        max_tokens=req.max_output_tokens,
        max_tokens_param="max_output_tokens",
        response_format=msgspec.structs.asdict(req.text.format) if req.text else None,
        format_param="text.format",
        tools=functions,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        tool_name_param="tools[{}].name",
        logprobs=req.top_logprobs,
        logprobs_param="top_logprobs",
        reasoning_effort=req.reasoning.effort if req.reasoning else None,
        effort_param="reasoning.effort",
        reasoning_budget=req.thinking_token_budget,
    )


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.prompt:
        raise InvalidRequest("`prompt` is not supported by this server", param="prompt")
    if req.conversation is not None and req.previous_response_id is not None:
        raise InvalidRequest("`conversation` and `previous_response_id` cannot both be given", param="conversation")
    if req.background and not req.store:
        raise InvalidRequest("`background` responses must be stored: send `store: true`", param="background")
    check_metadata(req.metadata)
    check_user(req.user)


class ResponsesController(Controller):
    path = "/"

    @post(
        ["/v1/responses", "/responses"],
        status_code=200,
        responses=documented(ResponseObject, "the response (with `stream`: typed events)"),
    )
    async def create(
        self, request: Request, data: JSONBody[ResponsesRequest], models: NamedDependency[ModelRegistry]
    ) -> Response:
        req = data
        state: StateService = request.app.state.state
        owner = caller_owner(request)
        generator = models.get(req.model)
        _refuse_unsupported(req)
        conversation = conversation_id(req.conversation)
        history = await _history(state, req, conversation, owner)
        turn_messages = input_messages(req.input, history)
        greq = generation_request(req, history + turn_messages)
        response = _envelope(generator, req)
        response.conversation = {"id": conversation} if conversation else None
        turn = Turn(owner, msgspec.json.encode(input_items(req.input)), turn_messages, req, [], conversation)
        if req.store:
            check_budget(turn.size(response), state.store.limits.max_response_bytes)
        generation = await core.start(generator, greq, request)
        turn.prompt = generation.prompts[0]  # what a gateway taking it over runs again
        builder = Output(generator, response, req.top_logprobs is not None)
        if req.store and (req.stream or req.background):
            run = start_run(state, response, turn, lambda run: _logged(builder, generation, run))
            if req.background:  # its row is committed before its id goes out: any gateway can be asked about it
                await state.store.writer.sync()
            if req.stream:
                return sse_stream(framed(run, cancel_on_exit=not req.background), generation.request_id)
            return json_response(response, generation.request_id)
        if req.stream:
            return sse_stream(_framed(builder.stream(generation)), generation.request_id)
        async for _ in builder.events(generation, await generation.collect(request)):
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
        if not await state.store.delete(response_id, caller_owner(request)):
            raise not_stored(response_id)
        return json_response(DeletedResponse(response_id))


async def _stored(request: Request, response_id: str):  # a StoredResponse
    """The caller's stored response: another key's is a 404, as an absent one."""
    found = await request.app.state.state.store.get(response_id, caller_owner(request))
    if found is None:
        raise not_stored(response_id)
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
        raise NotFound(
            f"No conversation with id {conversation!r} is stored here",
            param="conversation",
            code="conversation_not_found",
        )
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
    generator = app.state.models.get(req.model)
    greq = generation_request(req, [])
    greq.messages, greq.prompts = None, [turn.prompt]
    greq.replay, greq.owner, greq.meter = chunks, turn.owner, state.usage
    generation = await core.start(generator, greq)
    builder = Output(generator, response, req.top_logprobs is not None)
    start_run(state, response, turn, lambda run: _logged(builder, generation, run), logged)


def _envelope(generator: Generator, req: ResponsesRequest) -> ResponseObject:
    """The response as it starts: in progress, no output yet, the request's settings echoed."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"  # OpenAI echoes auto, tools or not
    return ResponseObject(
        id=f"resp_{uuid.uuid4().hex}",
        created_at=int(time.time()),
        model=generator.model_name,
        status="in_progress",
        output=[],
        usage=None,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        tool_choice=choice,
        tools=req.tools or [],
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
    )
