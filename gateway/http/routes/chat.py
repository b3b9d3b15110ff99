"""POST /v1/chat/completions, streamed (SSE) or not: OpenAI's chat dialect over the generation core."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.errors import InvalidRequest
from gateway.generate import core, events
from gateway.generate.events import LENGTH, TOOL_CALLS, Finish, Text, Thinking, ToolCallDelta
from gateway.generate.logprobs import chat_logprobs
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest
from gateway.generate.served_model import now_s
from gateway.generate.structured_outputs import format_param, output_format
from gateway.generate.tools import CallDelta
from gateway.generate.vision import image_part, parts_content
from gateway.http.routes.common import answer, documented, openai_usage
from gateway.http.routes.stream_runs import DIALECTS, Dialect, StreamId, start_stream
from gateway.policy.caller import Caller
from gateway.schemas.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    FunctionCall,
    FunctionCallDelta,
    TextPart,
    ToolCallChunk,
    ToolCallOut,
    echoed_tier,
)
from gateway.state.service import StateService

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: role, plain-text content, and any tool-call fields."""
    if not messages:
        raise InvalidRequest("`messages` must hold at least one message", param="messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidRequest(
                f"`messages[{i}].role` must be one of {', '.join(ROLES)}; got {message.role!r}",
                param=f"messages[{i}].role",
            )
        content = message.content
        if message.role == "user" and (content is None or content == []):  # as OpenAI: a user message says something
            raise InvalidRequest(
                f"`messages[{i}].content` is empty: a user message needs content", param=f"messages[{i}].content"
            )
        if isinstance(content, list):
            content = parts_content([_part(part, f"messages[{i}].content[{j}]") for j, part in enumerate(content)])
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls is not None:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        if message.reasoning_content or message.reasoning:  # as Qwen3's and DeepSeek's templates name it
            item["reasoning_content"] = message.reasoning_content or message.reasoning
        result.append(item)
    return result


def _part(part: TextPart, param: str) -> dict[str, Any]:
    """A content part as the core reads it: text, or an image by its URL (gateway/generate/vision.py)."""
    if part.type == "text" and part.text is not None:
        return {"type": "text", "text": part.text}
    url = part.image_url.get("url") if part.type == "image_url" and isinstance(part.image_url, dict) else None
    if isinstance(url, str):
        return image_part(url, f"{param}.image_url.url")
    raise InvalidRequest(f"`{param}` must be a text part or an image_url part with a url", param=param)


def core_request(data: ChatCompletionRequest) -> CoreRequest:
    """The body in the core's terms; only the chat dialect's own shapes are checked here."""
    if data.top_logprobs and not data.logprobs:
        raise InvalidRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    completion = data.max_completion_tokens is not None  # the newer name wins
    return CoreRequest(
        sampling=data,
        messages=message_dicts(data.messages),
        template=data.chat_template,
        template_kwargs=data.chat_template_kwargs,
        max_tokens=data.max_completion_tokens if completion else data.max_tokens,
        max_tokens_param="max_completion_tokens" if completion else "max_tokens",
        stop=data.stop,
        response_format=output_format(data),
        format_param=format_param(data),
        tools=data.tools,
        tool_choice=data.tool_choice,
        parallel_tool_calls=data.parallel_tool_calls,
        n=data.n,
        logprobs=(data.top_logprobs or 0) if data.logprobs else None,
        logprobs_param="top_logprobs",
        reasoning_effort=data.reasoning_effort or (data.reasoning or {}).get("effort"),
        reasoning_budget=data.thinking_token_budget or (data.reasoning or {}).get("max_tokens"),
    )


def finish_reason(finish: Finish, generation: core.Generation) -> str:
    """OpenAI's names: a call the request named ends with ``stop`` (as OpenAI's own API does);
    ``required`` and ``auto`` calls end with ``tool_calls``."""
    if finish.reason == TOOL_CALLS:
        return "stop" if generation.tools.mode == "named" else "tool_calls"
    return "length" if finish.reason == LENGTH else "stop"


class ChatController(Controller):
    path = "/v1/chat/completions"

    @post(
        "/",
        status_code=200,
        responses=documented(ChatCompletion, "the completion (with `stream`: chat.completion.chunk events)"),
    )
    async def create(
        self,
        request: Request,
        data: JSONBody[ChatCompletionRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
        stored: NamedDependency[StateService],
    ) -> Response:
        started = await start_stream(request, "chat", data, core_request(data), models, caller, stored)
        if isinstance(started, Response):  # a reconnecting client's rest, or a logged stream
            return started
        generation, ident = started
        return await answer(
            caller,
            generation,
            data.stream,
            partial(_chunks, generation, data, ident),
            partial(_body, generation, data),
            ident.id,
        )


def _body(generation: core.Generation, req: ChatCompletionRequest, choices: list[events.Choice]) -> ChatCompletion:
    served, with_logprobs = generation.served, req.logprobs
    out = []
    for choice in choices:
        message = AssistantMessage(content=choice.content)
        if choice.reasoning and not _excluded(req):
            message.reasoning_content = message.reasoning = choice.reasoning
        if choice.tool_calls:
            message.tool_calls = [
                ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in choice.tool_calls
            ]
        out.append(
            ChatChoice(
                index=choice.index,
                message=message,
                finish_reason=finish_reason(choice.finish, generation),  # type: ignore[arg-type]
                logprobs=chat_logprobs(served.token_texts, choice.logprobs) if with_logprobs else None,
            )
        )
    usage = events.total_usage([c.finish for c in choices], req.n)  # type: ignore[misc]
    return ChatCompletion(
        id=_completion_id(),
        created=now_s(),
        model=served.served_name,
        choices=out,
        usage=openai_usage(usage),
        service_tier=echoed_tier(req.service_tier),
    )


def _excluded(req: ChatCompletionRequest) -> bool:
    """OpenRouter's ``reasoning.exclude``: the model thinks, the answer leaves its thinking out."""
    return bool((req.reasoning or {}).get("exclude"))


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _tool_chunk(call: CallDelta) -> ToolCallChunk:
    if call.id is None:
        return ToolCallChunk(index=call.index, function=FunctionCallDelta(arguments=call.arguments))
    return ToolCallChunk(
        index=call.index,
        id=call.id,
        type="function",
        function=FunctionCallDelta(name=call.name, arguments=call.arguments),
    )


async def _chunks(
    generation: core.Generation, req: ChatCompletionRequest, ident: StreamId
) -> AsyncIterator[ChatCompletionChunk]:
    served, completion_id, created = generation.served, ident.id, ident.created
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    with_logprobs, tier = req.logprobs, echoed_tier(req.service_tier)

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=completion_id,
            created=created,
            model=served.served_name,
            choices=choices,
            usage=None if include_usage else msgspec.UNSET,
            service_tier=tier,
        )

    for index in range(generation.choices):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    finishes: dict[int, Finish] = {}
    async for event in generation.events():
        if isinstance(event, Text):
            logprobs = chat_logprobs(served.token_texts, event.logprobs) if with_logprobs else None
            yield chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(content=event.text), logprobs=logprobs)])
        elif isinstance(event, Thinking) and not _excluded(req):
            yield chunk(
                [
                    ChatChunkChoice(
                        index=event.index, delta=ChatDelta(reasoning_content=event.text, reasoning=event.text)
                    )
                ]
            )
        elif isinstance(event, ToolCallDelta):
            yield chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(tool_calls=[_tool_chunk(event.call)]))])
        elif isinstance(event, Finish):
            finishes[event.index] = event
            yield chunk(
                [ChatChunkChoice(index=event.index, delta=ChatDelta(), finish_reason=finish_reason(event, generation))]
            )
    if include_usage and len(finishes) == generation.choices:
        usage = events.total_usage([finishes[i] for i in range(generation.choices)], req.n)
        yield ChatCompletionChunk(
            id=completion_id,
            created=created,
            model=served.served_name,
            choices=[],
            usage=openai_usage(usage),
            service_tier=tier,
        )


DIALECTS["chat"] = Dialect(ChatCompletionRequest, core_request, _chunks, "chatcmpl-")
