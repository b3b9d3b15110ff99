"""POST /v1/chat/completions, streamed (SSE) or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, Response, post

from gateway.errors import InvalidRequest
from gateway.generation import Generator, TextDelta, now_s
from gateway.logprobs import chat_logprobs
from gateway.routes.common import Chunks, check_model, respond, usage
from gateway.schemas import ChatCompletionRequest, ChatMessage, decode_body
from gateway.validation import check_supported, new_request, request_id, stop_strings

ROLES = ("system", "developer", "user", "assistant", "tool")


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: role and plain-text content."""
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
        result.append({"role": message.role, "content": content or ""})
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
        messages = message_dicts(req.messages)
        limits = generator.client.limits()
        prompt_ids = await generator.run_in_pool(generator.chat_prompt_ids, messages, req.chat_template, req.chat_template_kwargs)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        rid = request_id(request.headers.get("x-request-id"))
        news = [new_request(req, prompt_ids, requested, param, limits, rid, generator.vocab_size, choice) for choice in range(req.n)]
        return await respond(request, generator, req, news, stops, "chatcmpl", _chunks, _body)


def _body(generator: Generator, completion_id: str, results: list[TextDelta], req: ChatCompletionRequest) -> dict:
    logprobs = req.logprobs_count() is not None
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": now_s(),
        "model": generator.model_name,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": chat_logprobs(generator.token_texts, result.logprobs) if logprobs else None,
                "finish_reason": result.finish_reason,
            }
            for index, result in enumerate(results)
        ],
        "usage": usage(results, req.n),
    }


async def _chunks(
    generator: Generator, deltas: AsyncIterator[tuple[int, TextDelta]], completion_id: str, include_usage: bool,
    choices: int, req: ChatCompletionRequest,
) -> AsyncIterator[dict]:
    make = Chunks(generator, completion_id, "chat.completion.chunk", include_usage)
    with_logprobs = req.logprobs_count() is not None

    def chunk(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None = None) -> dict:
        return make({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})

    for index in range(choices):
        yield chunk(index, {"role": "assistant", "content": ""}, None)
    async for index, delta in deltas:
        make.last[index] = delta
        if delta.text or (with_logprobs and delta.logprobs):
            logprobs = chat_logprobs(generator.token_texts, delta.logprobs) if with_logprobs else None
            yield chunk(index, {"content": delta.text}, None, logprobs)
        if delta.finish_reason is not None:
            yield chunk(index, {}, delta.finish_reason)
    if (final := make.usage_chunk(choices, req.n)) is not None:
        yield final
