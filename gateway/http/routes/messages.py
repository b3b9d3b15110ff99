"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the generation core.

The body becomes the core's request in ``gateway/http/routes/messages_input.py`` (messages, tools and
the thinking budget); this module answers with a message or Anthropic's stream events. Errors
under /v1/messages take Anthropic's shape (``gateway.errors``); the ``anthropic-version`` and
``anthropic-beta`` headers and a ``?beta=true`` query are tolerated, and ``x-api-key`` is accepted
as the key. A reasoning model's thinking comes as ``thinking`` blocks (``thinking.budget_tokens``
bounds it), and earlier thinking blocks go to the template as ``reasoning_content``; ``image`` blocks go to
an image-text model (gateway/generate/vision.py); documents and Anthropic's server tools are 400s naming the field.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import partial

import orjson
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.errors import GatewayError
from gateway.generate import core, events
from gateway.generate.events import LENGTH, STOP_SEQUENCE, TOOL_CALLS, Finish, Text, Thinking, ToolCallDelta, Usage
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest
from gateway.generate.tools import CallDelta
from gateway.http.routes.common import answer, documented, json_response
from gateway.http.routes.messages_cache import anthropic_usage, marked_tokens, retention_s
from gateway.http.routes.messages_input import core_request
from gateway.http.routes.stream_runs import DIALECTS, Dialect, StreamId, start_stream
from gateway.policy.caller import Caller
from gateway.schemas.anthropic import (
    AnthropicErrorBody,
    CountTokensRequest,
    CountTokensResponse,
    MessageResponse,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolUseBlock,
)
from gateway.state.service import StateService

STOP_REASONS = {events.END: "end_turn", STOP_SEQUENCE: "stop_sequence", LENGTH: "max_tokens", TOOL_CALLS: "tool_use"}


def _core_request(data: MessagesRequest) -> CoreRequest:
    req = core_request(data)
    req.retain_s = retention_s(data)  # cache_control's ttl: the prompt's blocks are kept ahead of others
    return req


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
        self,
        request: Request,
        data: JSONBody[MessagesRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
        stored: NamedDependency[StateService],
    ) -> Response:
        started = await start_stream(request, "messages", data, _core_request(data), models, caller, stored)
        if isinstance(started, Response):  # a reconnecting client's rest, or a logged stream
            return started
        generation, ident = started
        events = partial(_events, generation, data, ident)
        message = partial(_message, generation, await marked_tokens(generation, data))
        return await answer(caller, generation, data.stream, events, message, ident.id, True)

    @post(
        "/count_tokens",
        status_code=200,
        responses=documented(CountTokensResponse, "the prompt's length in tokens", AnthropicErrorBody),
    )
    async def count_tokens(
        self,
        data: JSONBody[CountTokensRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
    ) -> Response:
        (prompt,) = await core.prompt_ids(models.get(data.model), core_request(data), caller)
        return json_response(CountTokensResponse(len(prompt)))


def _message(generation: core.Generation, upto: int, choices: list[events.Choice]) -> MessageResponse:
    (choice,) = choices
    content: list[ThinkingBlock | TextBlock | ToolUseBlock] = (
        [ThinkingBlock(thinking=choice.reasoning)] if choice.reasoning else []
    )
    content += [TextBlock(text=choice.content)] if choice.content else []
    content += [ToolUseBlock(id=_tool_id(c.id), name=c.name, input=_input(c.arguments)) for c in choice.tool_calls]
    finish: Finish = choice.finish  # type: ignore[assignment]
    return MessageResponse(
        id=f"msg_{uuid.uuid4().hex}",
        model=generation.served.served_name,
        content=content,
        stop_reason=STOP_REASONS[finish.reason],
        stop_sequence=finish.stop_sequence,
        usage=anthropic_usage(finish.usage, upto),
    )


class _Blocks:
    """The content blocks of Anthropic's stream: which one is open, and the events that open, fill
    and close them (text, thinking, tool_use)."""

    def __init__(self) -> None:
        self.index = -1  # of the open block
        self.kind: str | None = None  # its type

    def open(self, kind: str, block: dict) -> list[dict]:
        events = [*self.close(), {"type": "content_block_start", "index": self.index + 1, "content_block": block}]
        self.index, self.kind = self.index + 1, kind
        return events

    def close(self) -> list[dict]:
        return list(_close_block(self.kind, self.index))

    def text(self, event: Text | Thinking) -> list[dict]:
        kind = "text" if isinstance(event, Text) else "thinking"
        events = []
        if self.kind != kind:
            empty = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events = self.open(kind, empty)
        events.append(
            {"type": "content_block_delta", "index": self.index, "delta": {"type": f"{kind}_delta", kind: event.text}}
        )
        return events

    def tool(self, call: CallDelta) -> list[dict]:
        events = []
        if call.id is not None:
            events = self.open(
                "tool_use", {"type": "tool_use", "id": _tool_id(call.id), "name": call.name, "input": {}}
            )
        if call.arguments:
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events


async def _events(generation: core.Generation, data: MessagesRequest, ident: StreamId) -> AsyncIterator[dict]:
    """Anthropic's stream: message_start, ping, per block content_block_start / _delta / _stop,
    then message_delta (stop reason, final usage) and message_stop; an error is an ``error`` event.
    message_start waits for the first output: only then is it known how much of the prompt the
    prefix cache served, which its usage counts apart as the closing usage does."""
    prompt_tokens = len(generation.prompts[0])
    upto = await marked_tokens(generation, data)  # tokens up to the last cache breakpoint

    def start() -> list[dict]:
        first = generation.first_usage or Usage(prompt_tokens)
        message = {
            "id": ident.id,
            "type": "message",
            "role": "assistant",
            "model": generation.served.served_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": anthropic_usage(Usage(first.prompt_tokens or prompt_tokens, 0, first.cached_tokens), upto),
        }
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    started = False
    blocks = _Blocks()
    finish: Finish | None = None
    try:
        async for event in generation.events():
            if not started:
                started = True
                for opening in start():
                    yield opening
            if isinstance(event, (Text, Thinking)) and event.text:
                for out in blocks.text(event):
                    yield out
            elif isinstance(event, ToolCallDelta):
                for out in blocks.tool(event.call):
                    yield out
            elif isinstance(event, Finish):
                finish = event
    except GatewayError as exc:
        if not started:
            for opening in start():
                yield opening
        yield exc.anthropic_body()
        return
    for closing in blocks.close():
        yield closing
    assert finish is not None
    delta = {"stop_reason": STOP_REASONS[finish.reason], "stop_sequence": finish.stop_sequence}
    yield {"type": "message_delta", "delta": delta, "usage": anthropic_usage(finish.usage, upto)}
    yield {"type": "message_stop"}


DIALECTS["messages"] = Dialect(MessagesRequest, _core_request, _events, "msg_", named=True)
