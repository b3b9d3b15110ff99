"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the generation core.

``system`` and the messages (text, ``tool_use``, ``tool_result`` and ``thinking`` blocks) become
chat messages, rendered by the chat template as chat completions are; tools with ``input_schema`` become function
tools, ``tool_choice`` auto / any / tool / none maps onto auto / required / named / none. Errors
under /v1/messages take Anthropic's shape (``gateway.errors``); the ``anthropic-version`` and
``anthropic-beta`` headers and a ``?beta=true`` query are tolerated, and ``x-api-key`` is accepted
as the key. A reasoning model's thinking comes as ``thinking`` blocks (``thinking.budget_tokens``
bounds it), and earlier thinking blocks go to the template as ``reasoning_content``; images,
documents and Anthropic's server tools are 400s naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import orjson
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway import core
from gateway.conversation_checks import ToolCallLedger, not_empty, required_text
from gateway.core import (
    LENGTH,
    STOP_SEQUENCE,
    TOOL_CALLS,
    Finish,
    GenerationRequest,
    Text,
    Thinking,
    ToolCallDelta,
    Usage,
)
from gateway.errors import GatewayError, InvalidRequest
from gateway.model_registry import ModelRegistry
from gateway.routes.common import answer, documented, json_response
from gateway.schemas import SamplingOptions
from gateway.schemas_anthropic import (
    AnthropicErrorBody,
    AnthropicMessage,
    AnthropicUsage,
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    SystemBlock,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)

STOP_REASONS = {core.END: "end_turn", STOP_SEQUENCE: "stop_sequence", LENGTH: "max_tokens", TOOL_CALLS: "tool_use"}
_SKIPPED = ("redacted_thinking",)


def _text(blocks: str | list[ContentBlock] | None, param: str) -> str:
    """Text blocks' text (a tool result's content, a system prompt); anything else is a 400."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise InvalidRequest(
                f"`{param}[{j}]` is a {block.type} block; only text is supported here", param=f"{param}[{j}]"
            )
    return "".join(block.text for block in blocks)  # type: ignore[misc]


def chat_messages(system: str | list[SystemBlock] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The conversation as chat messages: tool results become tool messages, tool uses an
    assistant's tool calls. As Anthropic's API: every message but a final assistant one has content,
    a ``tool_use`` has its ``id`` and ``name``, a ``tool_result`` answers an earlier ``tool_use``."""
    if not messages:
        raise InvalidRequest("`messages` must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _system_text(system)})
    calls = ToolCallLedger()
    for i, message in enumerate(messages):
        if message.role not in ("user", "assistant"):
            raise InvalidRequest(
                f"`messages[{i}].role` must be user or assistant; got {message.role!r}", param=f"messages[{i}].role"
            )
        if message.role == "user" or i < len(messages) - 1:
            not_empty(message.content, f"messages[{i}].content")
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        text, tool_calls, thinking = "", [], ""
        for j, block in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            if block.type == "text":
                text += block.text or ""
            elif block.type == "thinking":  # earlier thinking: for the templates that keep it
                thinking += block.thinking or ""
            elif block.type == "tool_use" and message.role == "assistant":
                calls.call(block.id, f"{param}.id")
                arguments = orjson.dumps(block.input or {}).decode()
                tool_calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": required_text(block.name, f"{param}.name"), "arguments": arguments},
                    }
                )
            elif block.type == "tool_result" and message.role == "user":
                calls.result(block.tool_use_id, f"{param}.tool_use_id", "tool_use")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": _text(block.content, f"{param}.content"),
                    }
                )
            elif block.type not in _SKIPPED:
                raise InvalidRequest(
                    f"`{param}`: {block.type} blocks are not supported in a {message.role} message on this server",
                    param=param,
                )
        if text or tool_calls or message.role == "assistant":
            extra = {"tool_calls": tool_calls} if tool_calls else {}
            out.append(
                {
                    "role": message.role,
                    "content": text,
                    **extra,
                    **({"reasoning_content": thinking} if thinking else {}),
                }
            )
    return out


def _system_text(blocks: list[SystemBlock]) -> str:
    for k, block in enumerate(blocks):
        if block.type != "text":
            raise InvalidRequest(f"`system[{k}].type` must be text; got {block.type!r}", param=f"system[{k}].type")
    return "\n".join(block.text for block in blocks)


def generation_request(req: CountTokensRequest) -> GenerationRequest:
    """The body in the core's terms; only the Messages dialect's own shapes are checked here. A
    count_tokens body brings no budget, stops or sampling settings to check."""
    functions, choice, parallel = _tools(req)
    whole = isinstance(req, MessagesRequest)
    return GenerationRequest(
        sampling=req if whole else SamplingOptions(),
        messages=chat_messages(req.system, req.messages),
        max_tokens=req.max_tokens if whole else None,
        stop=req.stop_sequences if whole else None,
        stop_param="stop_sequences",
        tools=functions,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        tool_name_param="tools[{}].name",
        reasoning_budget=_thinking_budget(req),
        budget_param="thinking.budget_tokens",
    )


def _thinking_budget(req: CountTokensRequest) -> int | None:
    """``thinking`` as a budget: enabled's own, none for disabled (0), none at all for adaptive."""
    thinking = req.thinking
    if thinking is None or thinking.type == "adaptive":
        return None
    if thinking.type == "disabled":
        return 0
    if thinking.type != "enabled" or thinking.budget_tokens is None:
        raise InvalidRequest(
            '`thinking` must be {"type": "enabled", "budget_tokens": N}, disabled or adaptive', param="thinking"
        )
    return thinking.budget_tokens


def _tools(req: CountTokensRequest) -> tuple[list[dict], str | dict | None, bool | None]:
    """Tools with ``input_schema`` as function tools; tool_choice auto / any / tool / none as auto /
    required / named / none (Anthropic's server tools are a 400)."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"`tools[{i}].type` {tool.type!r} is a server tool, which this server does not run",
                param=f"tools[{i}].type",
            )
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        functions.append({"type": "function", "function": function})
    choice, parallel = req.tool_choice, None
    mode: str | dict | None = None
    if choice is not None:
        parallel = False if choice.disable_parallel_tool_use else None
        modes: dict[str, str | dict] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }
        if choice.type not in modes:
            raise InvalidRequest(
                f"`tool_choice.type` must be auto, any, tool or none; got {choice.type!r}", param="tool_choice.type"
            )
        mode = modes[choice.type]
    return functions, mode, parallel


def _usage(usage: Usage) -> AnthropicUsage:
    """Anthropic counts prompt-cache reads apart: ``input_tokens`` are the others."""
    return AnthropicUsage(
        input_tokens=usage.prompt_tokens - usage.cached_tokens,
        output_tokens=usage.completion_tokens,
        cache_read_input_tokens=usage.cached_tokens,
    )


def _input(arguments: str) -> dict:
    """A call's arguments as the ``input`` object (arguments cut short by max_tokens: empty)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _close_block(kind: str | None, index: int) -> list[dict]:
    """The events that close the open block (a thinking block's signature first, as Anthropic's)."""
    if kind is None:
        return []
    signature = (
        [{"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": ""}}]
        if kind == "thinking"
        else []
    )
    return [*signature, {"type": "content_block_stop", "index": index}]


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesController(Controller):
    path = "/v1/messages"

    @post(
        "/",
        status_code=200,
        responses=documented(MessageResponse, "the message (with `stream`: Anthropic's events)", AnthropicErrorBody),
    )
    async def create(
        self, request: Request, data: JSONBody[MessagesRequest], models: NamedDependency[ModelRegistry]
    ) -> Response:
        generation = await core.start(models.get(data.model), generation_request(data), request)
        return await answer(
            request, generation, data.stream, partial(_events, generation), partial(_message, generation), named=True
        )

    @post(
        "/count_tokens",
        status_code=200,
        responses=documented(CountTokensResponse, "the prompt's length in tokens", AnthropicErrorBody),
    )
    async def count_tokens(
        self, request: Request, data: JSONBody[CountTokensRequest], models: NamedDependency[ModelRegistry]
    ) -> Response:
        (prompt,) = await core.prompt_ids(models.get(data.model), generation_request(data), request)
        return json_response(CountTokensResponse(len(prompt)))


def _message(generation: core.Generation, choices: list[core.Choice]) -> MessageResponse:
    (choice,) = choices
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = (
        [ThinkingBlock(thinking=choice.reasoning)] if choice.reasoning else []
    )
    content += [TextBlock(text=choice.content)] if choice.content else []
    content += [ToolUseBlock(id=_tool_id(c.id), name=c.name, input=_input(c.arguments)) for c in choice.tool_calls]
    finish: Finish = choice.finish  # type: ignore[assignment]
    return MessageResponse(
        id=f"msg_{uuid.uuid4().hex}",
        model=generation.generator.model_name,
        content=content,
        stop_reason=STOP_REASONS[finish.reason],
        stop_sequence=finish.stop_sequence,
        usage=_usage(finish.usage),
    )


async def _events(generation: core.Generation) -> AsyncIterator[dict]:
    """Anthropic's stream: message_start, ping, per block content_block_start / _delta / _stop,
    then message_delta (stop reason, final usage) and message_stop; an error is an ``error`` event.
    message_start waits for the first output: only then is it known how much of the prompt the
    prefix cache served, which its usage counts apart as the closing usage does."""
    prompt_tokens = len(generation.prompts[0])

    def start() -> list[dict]:
        first = generation.first_usage or Usage(prompt_tokens)
        message = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": generation.generator.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(Usage(first.prompt_tokens or prompt_tokens, 0, first.cached_tokens)),
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    started = False
    blocks = -1  # index of the open block
    kind = None  # its type
    finish: Finish | None = None
    try:
        async for event in generation.events():
            if not started:
                started = True
                for opening in start():
                    yield opening
            if isinstance(event, (Text, Thinking)) and event.text:
                block_type, field = ("text", "text") if isinstance(event, Text) else ("thinking", "thinking")
                if kind != block_type:
                    for closing in _close_block(kind, blocks):
                        yield closing
                    blocks, kind = blocks + 1, block_type
                    opened = (
                        {"type": "text", "text": ""}
                        if block_type == "text"
                        else {"type": "thinking", "thinking": "", "signature": ""}
                    )
                    yield {"type": "content_block_start", "index": blocks, "content_block": opened}
                yield {
                    "type": "content_block_delta",
                    "index": blocks,
                    "delta": {"type": f"{field}_delta", field: event.text},
                }
            elif isinstance(event, ToolCallDelta):
                call = event.call
                if call.id is not None:
                    for closing in _close_block(kind, blocks):
                        yield closing
                    blocks, kind = blocks + 1, "tool_use"
                    block = {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}
                    yield {"type": "content_block_start", "index": blocks, "content_block": block}
                if call.arguments:
                    yield {
                        "type": "content_block_delta",
                        "index": blocks,
                        "delta": {"type": "input_json_delta", "partial_json": call.arguments},
                    }
            elif isinstance(event, Finish):
                finish = event
    except GatewayError as exc:
        if not started:
            for opening in start():
                yield opening
        yield exc.anthropic_body()
        return
    for closing in _close_block(kind, blocks):
        yield closing
    assert finish is not None
    delta = {"stop_reason": STOP_REASONS[finish.reason], "stop_sequence": finish.stop_sequence}
    yield {"type": "message_delta", "delta": delta, "usage": _usage(finish.usage)}
    yield {"type": "message_stop"}
