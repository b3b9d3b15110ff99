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

import time
import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from gateway import core
from gateway.conversation_checks import ToolCallLedger, json_arguments, not_empty, required_text
from gateway.core import GenerationRequest
from gateway.errors import InvalidRequest, NotFound
from gateway.generation import Generator
from gateway.model_registry import ModelRegistry
from gateway.response_store import ResponseStore, StoredResponse
from gateway.routes.common import documented, event_stream, json_response
from gateway.routes.response_output import Output, output_messages
from gateway.schemas_responses import DeletedResponse, InputItem, InputPart, ResponseObject, ResponsesRequest, TextConfig

_TEXT_PARTS = ("input_text", "output_text", "text")


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


def generation_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> GenerationRequest:
    """The body in the core's terms, ``conversation`` being the chat messages of the history and
    the input; only the Responses dialect's own shapes are checked here."""
    for name, value in (("background", req.background), ("conversation", req.conversation), ("prompt", req.prompt)):
        if value:
            raise InvalidRequest(f"`{name}` is not supported by this server", param=name)
    functions = []
    for i, tool in enumerate(req.tools or []):  # in chat's shape, without null fields (the template and the Hermes prompt want none)
        if tool.type != "function":
            raise InvalidRequest(f"`tools[{i}].type` {tool.type!r} is not supported: only function tools are", param=f"tools[{i}].type")
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        functions.append({"type": "function", "function": {k: v for k, v in function.items() if k != "description" or v is not None}})
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest('`tool_choice` must be none, auto, required or {"type": "function", "name": ...}', param="tool_choice")
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
    )


class ResponsesController(Controller):
    path = "/"

    @post(["/v1/responses", "/responses"], status_code=200, responses=documented(ResponseObject, "the response (with `stream`: typed events)"))
    async def create(self, request: Request, data: JSONBody[ResponsesRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        store: ResponseStore = request.app.state.response_store
        generator = models.get(req.model)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = store.get(req.previous_response_id)
            if previous is None:
                raise InvalidRequest(
                    f"Previous response with id {req.previous_response_id!r} not found",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous.conversation
        conversation = history + input_messages(req.input, history)
        generation = await core.start(generator, generation_request(req, conversation), request)
        response = _envelope(generator, req)
        builder = Output(generator, response, req.top_logprobs is not None)
        if req.stream:
            return event_stream(builder.stream(generation, store, conversation), generation.request_id, named=True)
        async for _ in builder.events(generation, await generation.collect(request)):
            pass
        if req.store:
            store.put(response.id, StoredResponse(response, conversation + output_messages(response.output)))
        return json_response(response, generation.request_id)

    @get(["/v1/responses/{response_id:str}", "/responses/{response_id:str}"], responses=documented(ResponseObject, "a stored response"))
    async def retrieve(self, request: Request, response_id: FromPath[str]) -> Response:
        return json_response(_stored(request, response_id).body)

    @delete(
        ["/v1/responses/{response_id:str}", "/responses/{response_id:str}"],
        status_code=200,
        responses=documented(DeletedResponse, "the response is forgotten"),
    )
    async def remove(self, request: Request, response_id: FromPath[str]) -> Response:
        _stored(request, response_id)
        request.app.state.response_store.delete(response_id)
        return json_response(DeletedResponse(response_id))


def _stored(request: Request, response_id: FromPath[str]) -> StoredResponse:
    found = request.app.state.response_store.get(response_id)
    if found is None:
        raise NotFound(f"No response with id {response_id!r} is stored here", param="response_id", code="not_found")
    return found


def _envelope(generator: Generator, req: ResponsesRequest) -> ResponseObject:
    """The response as it starts: in progress, no output yet, the request's settings echoed."""
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
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
    )
