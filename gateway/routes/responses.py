"""POST /v1/responses (and /responses), GET and DELETE /v1/responses/{id}: OpenAI's Responses API
over the generation core.

The input (a string, or message / function_call / function_call_output items, after any stored
``previous_response_id`` conversation) becomes chat messages, rendered by the chat template as chat
completions are; ``instructions`` go first as a system message and, as with OpenAI, are not carried
to a continuation. The output is a ``message`` item with ``output_text`` and a ``function_call``
item per call. Streamed, it is OpenAI's typed events in order, each with an increasing
``sequence_number``.

Accepted and ignored: ``reasoning`` (nothing reasons here, so no reasoning items and 0 reasoning
tokens), ``truncation`` (always ``disabled``: a prompt too long is a 400), ``include``,
``metadata``, ``user``, ``max_tool_calls``, ``service_tier``, ``prompt_cache_key``. Refused with a
400 naming the field: ``background``, ``conversation``, ``prompt``, built-in tools (anything but
``function`` in ``tools``), image and file inputs, ``item_reference`` items.
"""

from __future__ import annotations

import itertools
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
from gateway.core import LENGTH, Finish, GenerationRequest, Text, ToolCallDelta
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.generation import Generator
from gateway.logprobs import chat_logprobs
from gateway.model_registry import ModelRegistry
from gateway.routes.common import documented, json_response
from gateway.routes.conversations import conversation_id
from gateway.routes.response_runs import Turn, chunk_hook, follow, framed, input_items, not_stored, sse_stream, start_run
from gateway.schemas import MAX_LOGPROBS
from gateway.schemas_responses import (
    DeletedResponse,
    FunctionCallItem,
    IncompleteDetails,
    InputItem,
    InputPart,
    InputTokensDetails,
    Logprob,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from gateway.state.limits import check_budget, check_metadata, check_user
from gateway.state.runs import Event
from gateway.state.service import StateService
from gateway.tools import ToolPlan, tool_plan
from gateway.validation import format_guide, request_id

log = logging.getLogger(__name__)

_TEXT_PARTS = ("input_text", "output_text", "text")
_encoder = msgspec.json.Encoder()


def _text(content: str | list[InputPart] | None, param: str) -> str:
    """A content field's text: a string, or text parts (anything else is a 400 naming it)."""
    if content is None or isinstance(content, str):
        return content or ""
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequest(f"`{param}[{j}]` is a {part.type} part; only text is supported here", param=f"{param}[{j}]")
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
                raise InvalidRequest(f"`input[{i}].role` must be user, assistant, system or developer; got {item.role!r}", param=f"input[{i}].role")
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
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input[{i}].output")})
        elif item.type == "reasoning":
            continue  # another model's reasoning: nothing here reads it
        else:
            raise InvalidRequest(
                f"`input[{i}].type` {item.type!r} is not supported (message, function_call, function_call_output)", param=f"input[{i}].type"
            )
    if not messages:
        raise InvalidRequest("`input` must hold at least one item", param="input")
    return messages


def _tools(req: ResponsesRequest) -> ToolPlan:
    """Function tools in the chat shape the core's tool plan reads; built-in tools are a 400."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.type != "function":
            raise InvalidRequest(f"`tools[{i}].type` {tool.type!r} is not supported: only function tools are", param=f"tools[{i}].type")
        functions.append({"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest('`tool_choice` must be none, auto, required or {"type": "function", "name": ...}', param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    plan = tool_plan(functions, choice, req.parallel_tool_calls, "tools[{}].name")
    for tool in plan.tools:  # the template and the Hermes prompt want no null fields
        if tool.get("description") is None:
            tool.pop("description", None)
    return plan


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.prompt:
        raise InvalidRequest("`prompt` is not supported by this server", param="prompt")
    if req.conversation is not None and req.previous_response_id is not None:
        raise InvalidRequest("`conversation` and `previous_response_id` cannot both be given", param="conversation")
    if req.background and not req.store:
        raise InvalidRequest("`background` responses must be stored: send `store: true`", param="background")
    check_metadata(req.metadata)
    check_user(req.user)
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"`top_logprobs` must be between 0 and {MAX_LOGPROBS}; got {req.top_logprobs}", param="top_logprobs")


class ResponsesController(Controller):
    path = "/"

    @post(["/v1/responses", "/responses"], status_code=200, responses=documented(ResponseObject, "the response (with `stream`: typed events)"))
    async def create(self, request: Request, data: JSONBody[ResponsesRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        state: StateService = request.app.state.state
        owner = caller_owner(request)
        generator = models.get(req.model)
        _refuse_unsupported(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await state.store.get(req.previous_response_id, owner)
            if previous is None or previous.running:
                what = "not found" if previous is None else "still in progress"
                raise InvalidRequest(
                    f"Previous response with id {req.previous_response_id!r} {what}", param="previous_response_id", code="previous_response_not_found"
                )
            history = await state.store.history(req.previous_response_id, owner)
        conversation = conversation_id(req.conversation)
        if conversation is not None:
            history = await _conversation_history(state, conversation, owner)
        turn_messages = input_messages(req.input, history)
        plan = _tools(req)
        guide = format_guide(msgspec.structs.asdict(req.text.format) if req.text else None, "text.format")
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        prompt = await core.chat_prompt(generator, system + history + turn_messages, plan)
        response = _envelope(generator, req)
        response.conversation = {"id": conversation} if conversation else None
        turn = Turn(owner, msgspec.json.encode(input_items(req.input)), turn_messages, req, prompt, conversation)
        if req.store:
            check_budget(turn.size(response), state.store.limits.max_response_bytes)
        generation = await core.start(
            generator, _generation_request(req, prompt, request_id(request.headers.get("x-request-id")), plan, guide), request
        )
        builder = _Output(generator, response, req.top_logprobs is not None)
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

    @get(["/v1/responses/{response_id:str}", "/responses/{response_id:str}"], responses=documented(ResponseObject, "a stored response"))
    async def retrieve(
        self, request: Request, response_id: FromPath[str], stream: FromQuery[bool] = False, starting_after: FromQuery[int] = -1
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


async def _stored(request: Request, response_id: str):  # noqa: ANN202 - a StoredResponse
    """The caller's stored response: another key's is a 404, as an absent one."""
    found = await request.app.state.state.store.get(response_id, caller_owner(request))
    if found is None:
        raise not_stored(response_id)
    return found


async def _conversation_history(state: StateService, conversation: str, owner: str) -> list[dict[str, Any]]:
    items = await state.store.conversations.items(conversation, owner)
    if items is None:
        raise NotFound(f"No conversation with id {conversation!r} is stored here", param="conversation", code="conversation_not_found")
    usable = [msgspec.convert(item, InputItem) for item in items if item.get("type") in ("message", "function_call", "function_call_output")]
    return input_messages(usable) if usable else []


def _generation_request(req: ResponsesRequest, prompt: list[int], rid: str, plan: ToolPlan, guide) -> GenerationRequest:  # noqa: ANN001
    return GenerationRequest(
        prompts=[prompt],
        sampling=req,
        max_tokens=req.max_output_tokens,
        request_id=rid,
        max_tokens_param="max_output_tokens",
        guide=guide,
        tools=plan,
        logprobs=req.top_logprobs,
    )


async def _logged(builder: _Output, generation: core.Generation, run) -> AsyncIterator[Event]:  # noqa: ANN001
    generation.req.on_output = chunk_hook(run, len(generation.req.replay))
    async for event in builder.stream(generation):
        yield event


async def _framed(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    async for event in events:
        yield event.sse()


async def resume(app: Litestar, response: ResponseObject, turn: Turn, chunks: list[RequestOutput], logged: list[Event]) -> None:
    """Run on here a response a dead gateway was running (``response_runs.take_over``)."""
    state: StateService = app.state.state
    req = turn.request
    generator = app.state.models.get(req.model)
    plan = _tools(req)
    guide = format_guide(msgspec.structs.asdict(req.text.format) if req.text else None, "text.format")
    greq = _generation_request(req, turn.prompt, uuid.uuid4().hex, plan, guide)
    greq.replay, greq.owner, greq.meter = chunks, turn.owner, state.usage
    generation = await core.start(generator, greq)
    builder = _Output(generator, response, req.top_logprobs is not None)
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
    )


class _Output:
    """Builds the output items from the core's events, as the stream's events (the non-streamed
    answer is the same walk over the collected choice, its events dropped)."""

    def __init__(self, generator: Generator, response: ResponseObject, with_logprobs: bool) -> None:
        self.generator = generator
        self.response = response
        self.with_logprobs = with_logprobs
        self._sequence = itertools.count()
        self._open: OutputMessage | FunctionCallItem | None = None

    def event(self, kind: str, **fields: Any) -> Event:
        """The event as JSON now: later changes to the items it names (text growing) are not in it."""
        seq = next(self._sequence)
        return Event(kind, seq, _encoder.encode({"type": kind, "sequence_number": seq, **fields}))

    def _item_id(self, prefix: str) -> str:
        """Ids that come out the same when a gateway replays this response after a takeover."""
        return f"{prefix}_{self.response.id.removeprefix('resp_')}{len(self.response.output):04x}"

    async def stream(self, generation: core.Generation) -> AsyncIterator[Event]:
        yield self.event("response.created", response=self.response)
        yield self.event("response.in_progress", response=self.response)
        try:
            async for event in self.events(generation, None):
                yield event
        except GatewayError as exc:
            self.response.status = "failed"
            self.response.error = ResponseError(exc.error_type, exc.message)
            yield self.event("response.failed", response=self.response)

    async def events(self, generation: core.Generation, choices: list[core.Choice] | None) -> AsyncIterator[Event]:
        """The items' events, from the live stream (``choices`` None) or from a collected choice."""
        finish: Finish | None = None
        async for event in _replay(choices[0]) if choices else generation.events():
            if isinstance(event, Text) and (event.text or event.logprobs):
                for out in self._text(event):
                    yield out
            elif isinstance(event, ToolCallDelta):
                for out in self._call(event):
                    yield out
            elif isinstance(event, Finish):
                finish = event
        if not self.response.output:  # nothing at all was said: an empty message, as OpenAI answers
            for out in self._text(Text(0, "")):
                yield out
        incomplete = finish is not None and finish.reason == LENGTH
        for out in self._close("incomplete" if incomplete else "completed"):
            yield out
        usage = finish.usage if finish else core.Usage()
        self.response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(usage.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(0),
            total_tokens=usage.total_tokens,
        )
        self.response.status = "incomplete" if incomplete else "completed"
        self.response.incomplete_details = IncompleteDetails("max_output_tokens") if incomplete else None
        yield self.event(f"response.{self.response.status}", response=self.response)

    def _text(self, event: Text) -> list[Event]:
        out = []
        if not isinstance(self._open, OutputMessage):
            out += self._close("completed")
            self._open = OutputMessage(id=self._item_id("msg"), status="in_progress", content=[])
            self.response.output.append(self._open)
            out.append(self.event("response.output_item.added", output_index=len(self.response.output) - 1, item=self._open))
            self._open.content.append(OutputText(text=""))
            out.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._open.id,
                    output_index=len(self.response.output) - 1,
                    content_index=0,
                    part=self._open.content[0],
                )
            )
        part = self._open.content[0]
        logprobs = self._logprobs(event)
        part.text += event.text
        part.logprobs.extend(logprobs)
        if event.text or logprobs:
            out.append(
                self.event(
                    "response.output_text.delta",
                    item_id=self._open.id,
                    output_index=len(self.response.output) - 1,
                    content_index=0,
                    delta=event.text,
                    logprobs=logprobs,
                )
            )
        return out

    def _logprobs(self, event: Text) -> list[Logprob]:
        if not self.with_logprobs:
            return []
        return [msgspec.convert(entry, Logprob) for entry in chat_logprobs(self.generator.token_texts, event.logprobs)["content"]]

    def _call(self, event: ToolCallDelta) -> list[Event]:
        out = []
        call = event.call
        if call.id is not None:
            out += self._close("completed")
            call_id = self._item_id("call")
            self._open = FunctionCallItem(id=self._item_id("fc"), call_id=call_id, name=call.name or "", arguments="", status="in_progress")
            self.response.output.append(self._open)
            out.append(self.event("response.output_item.added", output_index=len(self.response.output) - 1, item=self._open))
        item = self._open
        if isinstance(item, FunctionCallItem) and call.arguments:
            item.arguments += call.arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta", item_id=item.id, output_index=len(self.response.output) - 1, delta=call.arguments
                )
            )
        return out

    def _close(self, status: str) -> list[Event]:
        """The done events of the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.response.output.index(item)
        out = []
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out.append(
                self.event("response.output_text.done", item_id=item.id, output_index=index, content_index=0, text=part.text, logprobs=part.logprobs)
            )
            out.append(self.event("response.content_part.done", item_id=item.id, output_index=index, content_index=0, part=part))
        else:
            out.append(
                self.event("response.function_call_arguments.done", item_id=item.id, output_index=index, name=item.name, arguments=item.arguments)
            )
        item.status = status
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _replay(choice: core.Choice) -> AsyncIterator[core.Event]:
    """A collected choice as the events that made it."""
    if choice.text or choice.logprobs:
        yield Text(0, choice.text if not choice.tool_calls else (choice.content or ""), choice.logprobs)
    for i, call in enumerate(choice.tool_calls):
        yield ToolCallDelta(0, call.delta(i))
    if choice.finish is not None:
        yield choice.finish
