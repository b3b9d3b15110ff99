"""POST /v1/chat/completions, streamed (SSE) or not: OpenAI's chat dialect over the generation core."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway import core
from gateway.core import (
    LENGTH,
    TOOL_CALLS,
    Finish,
    GenerationRequest,
    Text,
    ToolCallDelta,
)
from gateway.errors import InvalidRequest
from gateway.generation import Generator, now_s
from gateway.logprobs import chat_logprobs
from gateway.model_registry import ModelRegistry
from gateway.routes.common import (
    documented,
    event_stream,
    json_response,
    openai_usage,
)
from gateway.schemas import (
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
    ToolCallChunk,
    ToolCallOut,
)
from gateway.tools import CallDelta, ToolPlan, check_tool_calls, tool_plan
from gateway.validation import check_supported, request_id, response_guide, stop_strings

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: role, plain-text content, and any tool-call fields."""
    if not messages:
        raise InvalidRequest("`messages` must hold at least one message", param="messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise InvalidRequest(f"`messages[{i}].role` must be one of {', '.join(ROLES)}; got {message.role!r}", param=f"messages[{i}].role")
        content = message.content
        if message.role == "user" and (content is None or content == []):  # as OpenAI: a user message says something
            raise InvalidRequest(f"`messages[{i}].content` is empty: a user message needs content", param=f"messages[{i}].content")
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequest(f"`messages[{i}].content` may only hold text parts", param=f"messages[{i}].content")
            content = "".join(part.text for part in content)  # type: ignore[misc]
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            item["tool_calls"] = check_tool_calls(message.tool_calls, f"messages[{i}].tool_calls")
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        result.append(item)
    return result


def check_request_template(request: Request, template: str | None) -> None:
    """A request's own ``chat_template`` is code: refused unless the server allows it."""
    if template is not None and not request.app.state.allow_request_chat_template:
        raise InvalidRequest(
            "`chat_template` in a request is refused on this server (templates come from the server side; "
            "start it with --allow-request-chat-template to allow them)",
            param="chat_template",
        )


def finish_reason(finish: Finish, plan: ToolPlan) -> str:
    """OpenAI's names: a call the request named ends with ``stop`` (as OpenAI's own API does);
    ``required`` and ``auto`` calls end with ``tool_calls``."""
    if finish.reason == TOOL_CALLS:
        return "stop" if plan.mode == "named" else "tool_calls"
    return "length" if finish.reason == LENGTH else "stop"


class ChatController(Controller):
    path = "/v1/chat/completions"

    @post("/", status_code=200, responses=documented(ChatCompletion, "the completion (with `stream`: chat.completion.chunk events)"))
    async def create(self, request: Request, data: JSONBody[ChatCompletionRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        generator = models.get(req.model)
        check_supported(req)
        stops = stop_strings(req.stop)
        check_request_template(request, req.chat_template)
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        logprobs = req.logprobs_count()
        guide = response_guide(req.response_format)
        prompt = await core.chat_prompt(generator, message_dicts(req.messages), plan, req.chat_template, req.chat_template_kwargs, request)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        generation = await core.start(
            generator,
            GenerationRequest(
                prompts=[prompt],
                sampling=req,
                max_tokens=requested,
                request_id=request_id(request.headers.get("x-request-id")),
                max_tokens_param=param,
                stops=stops,
                guide=guide,
                tools=plan,
                n=req.n,
                logprobs=logprobs,
            ),
            request,
        )
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return event_stream(_chunks(generator, generation, completion_id, req, plan), generation.request_id)
        choices = await generation.collect(request)
        return json_response(_body(generator, completion_id, choices, req, plan), generation.request_id)


def _body(generator: Generator, completion_id: str, choices: list[core.Choice], req: ChatCompletionRequest, plan: ToolPlan) -> ChatCompletion:
    with_logprobs = req.logprobs_count() is not None
    out = []
    for choice in choices:
        message = AssistantMessage(content=choice.content)
        if choice.tool_calls:
            message.tool_calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in choice.tool_calls]
        out.append(
            ChatChoice(
                index=choice.index,
                message=message,
                finish_reason=finish_reason(choice.finish, plan),  # type: ignore[arg-type]
                logprobs=chat_logprobs(generator.token_texts, choice.logprobs) if with_logprobs else None,
            )
        )
    usage = core.total_usage([c.finish for c in choices], req.n)  # type: ignore[misc]
    return ChatCompletion(id=completion_id, created=now_s(), model=generator.model_name, choices=out, usage=openai_usage(usage))


def _tool_chunk(call: CallDelta) -> ToolCallChunk:
    if call.id is None:
        return ToolCallChunk(index=call.index, function=FunctionCallDelta(arguments=call.arguments))
    return ToolCallChunk(index=call.index, id=call.id, type="function", function=FunctionCallDelta(name=call.name, arguments=call.arguments))


async def _chunks(
    generator: Generator,
    generation: core.Generation,
    completion_id: str,
    req: ChatCompletionRequest,
    plan: ToolPlan,
) -> AsyncIterator[ChatCompletionChunk]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    with_logprobs = req.logprobs_count() is not None
    created = now_s()

    def chunk(choices: list[ChatChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=completion_id, created=created, model=generator.model_name, choices=choices, usage=None if include_usage else msgspec.UNSET
        )

    for index in range(generation.choices):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    finishes: dict[int, Finish] = {}
    async for event in generation.events():
        if isinstance(event, Text):
            logprobs = chat_logprobs(generator.token_texts, event.logprobs) if with_logprobs else None
            yield chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(content=event.text), logprobs=logprobs)])
        elif isinstance(event, ToolCallDelta):
            yield chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(tool_calls=[_tool_chunk(event.call)]))])
        elif isinstance(event, Finish):
            finishes[event.index] = event
            yield chunk([ChatChunkChoice(index=event.index, delta=ChatDelta(), finish_reason=finish_reason(event, plan))])
    if include_usage and len(finishes) == generation.choices:
        usage = core.total_usage([finishes[i] for i in range(generation.choices)], req.n)
        yield ChatCompletionChunk(id=completion_id, created=created, model=generator.model_name, choices=[], usage=openai_usage(usage))
