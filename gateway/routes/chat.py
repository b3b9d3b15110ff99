"""POST /v1/chat/completions, streamed (SSE) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from litestar import Controller, Request, Response, post

from gateway.errors import InvalidRequest
from gateway.generation import Generator, TextDelta, now_s
from gateway.logprobs import chat_logprobs
from gateway.routes.common import Chunks, check_model, respond, usage
from gateway.schemas import ChatCompletionRequest, ChatMessage, decode_body
from gateway.tools import ToolPlan, prepare_messages, template_variables, tool_plan
from gateway.validation import check_supported, checked_guide, new_request, request_id, stop_strings

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
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise InvalidRequest(f"`messages[{i}].content` may only hold text parts", param=f"messages[{i}].content")
            content = "".join(part.text for part in content)  # type: ignore[misc]
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.tool_calls:
            item["tool_calls"] = message.tool_calls
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        result.append(item)
    return result


class ChatController(Controller):
    path = "/v1/chat/completions"

    @post("/", status_code=200)
    async def create(self, request: Request, generator: Generator) -> Response:
        req = decode_body(await request.body(), ChatCompletionRequest)
        check_model(req.model, generator.model_name)
        check_supported(req)
        stops = stop_strings(req)
        if req.chat_template is not None and not request.app.state.allow_request_chat_template:
            raise InvalidRequest(
                "`chat_template` in a request is refused on this server (templates come from the server side; "
                "start it with --allow-request-chat-template to allow them)", param="chat_template",
            )
        plan = tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls)
        template_source = req.chat_template or generator.template.source
        messages = prepare_messages(message_dicts(req.messages), plan, template_source)
        variables = {**(req.chat_template_kwargs or {}), **template_variables(plan, template_source)}
        limits = generator.client.limits()
        prompt_ids = await generator.run_in_pool(generator.chat_prompt_ids, messages, req.chat_template, variables)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        rid = request_id(request.headers.get("x-request-id"))
        guide = checked_guide(plan.guide(), "tools")
        news = [new_request(req, prompt_ids, requested, param, limits, rid, generator.vocab_size, choice, guide) for choice in range(req.n)]
        return await respond(request, generator, req, news, stops, "chatcmpl", partial(_chunks, plan=plan), partial(_body, plan=plan))


def _message(result: TextDelta, plan: ToolPlan) -> tuple[dict, str | None]:
    """The assistant message of one choice and its finish reason (``tool_calls`` when it calls)."""
    parser = plan.parser()
    if parser is None:
        return {"role": "assistant", "content": result.text}, result.finish_reason
    parser.push(result.text)
    parser.finish()
    message: dict[str, Any] = {"role": "assistant", "content": parser.content()}
    if parser.calls:
        message["tool_calls"] = [call.as_dict() for call in parser.calls]
    return message, "tool_calls" if parser.calls and result.finish_reason == "stop" else result.finish_reason


def _body(generator: Generator, completion_id: str, results: list[TextDelta], req: ChatCompletionRequest, plan: ToolPlan) -> dict:
    logprobs = req.logprobs_count() is not None
    choices = []
    for index, result in enumerate(results):
        message, finish_reason = _message(result, plan)
        choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(generator.token_texts, result.logprobs) if logprobs else None,
            "finish_reason": finish_reason,
        })
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": now_s(),
        "model": generator.model_name,
        "choices": choices,
        "usage": usage(results, req.n),
    }


async def _chunks(
    generator: Generator, deltas: AsyncIterator[tuple[int, TextDelta]], completion_id: str, include_usage: bool,
    choices: int, req: ChatCompletionRequest, plan: ToolPlan,
) -> AsyncIterator[dict]:
    make = Chunks(generator, completion_id, "chat.completion.chunk", include_usage)
    with_logprobs = req.logprobs_count() is not None
    parsers = [plan.parser() for _ in range(choices)]

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        return make({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    for index in range(choices):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for index, delta in deltas:
        make.last[index] = delta
        parser = parsers[index]
        content, calls = (delta.text, []) if parser is None else parser.push(delta.text)
        if delta.finish_reason is not None and parser is not None:
            rest, more = parser.finish()
            content, calls = content + rest, calls + more
        if content or (with_logprobs and delta.logprobs):
            yield chunk(index, {"content": content}, None, chat_logprobs(generator.token_texts, delta.logprobs) if with_logprobs else None)
        if calls:
            yield chunk(index, {"tool_calls": calls})
        if delta.finish_reason is not None:
            called = parser is not None and parser.calls and delta.finish_reason == "stop"
            yield chunk(index, {}, "tool_calls" if called else delta.finish_reason)
    if (final := make.usage_chunk(choices, req.n)) is not None:
        yield final
