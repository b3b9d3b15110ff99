"""POST /v1/completions (legacy text completions): a prompt string or token ids, streamed or not."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from litestar import Controller, Request, Response, post
from litestar.response import Stream

from common.protocol import NewRequest
from gateway.admission import Slot
from gateway.errors import InvalidRequest
from gateway.generation import Generator, now_s
from gateway.routes.common import check_model, json_response, unless_disconnected, usage
from gateway.schemas import CompletionRequest, decode_body
from gateway.streaming import SSE_HEADERS, sse_events
from gateway.validation import check_supported, new_request, request_id


class CompletionsController(Controller):
    path = "/v1/completions"

    @post("/", status_code=200)
    async def create(self, request: Request, generator: Generator) -> Response:
        req = decode_body(await request.body(), CompletionRequest)
        check_model(req.model, generator.model_name)
        check_supported(req)
        if req.echo:
            raise InvalidRequest("`echo` is not supported yet", param="echo")
        limits = generator.client.limits()
        if isinstance(req.prompt, str):
            prompt_ids = await generator.run_in_pool(generator.text_prompt_ids, req.prompt)
        else:
            prompt_ids = req.prompt
        new = new_request(
            req, prompt_ids, req.max_tokens if req.max_tokens is not None else 16, "max_tokens", limits,
            request_id(request.headers.get("x-request-id")),
        )
        slot = await generator.admission.acquire()  # 429 now, before any response starts
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = _chunks(generator, new, slot, completion_id, include_usage)
            return Stream(sse_events(chunks), media_type="text/event-stream", headers={**SSE_HEADERS, "X-Request-Id": new.request_id})
        result = await unless_disconnected(request, generator.complete(new, slot))
        return json_response({
            "id": completion_id,
            "object": "text_completion",
            "created": now_s(),
            "model": generator.model_name,
            "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": usage(result),
        }, new.request_id)


async def _chunks(generator: Generator, new: NewRequest, slot: Slot, completion_id: str, include_usage: bool) -> AsyncIterator[dict]:
    created = now_s()
    last = None
    async for delta in generator.stream(new, slot):
        last = delta
        body = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": generator.model_name,
            "choices": [{"index": 0, "text": delta.text, "logprobs": None, "finish_reason": delta.finish_reason}],
        }
        if include_usage:
            body["usage"] = None
        if delta.text or delta.finish_reason is not None:
            yield body
    if include_usage and last is not None:
        yield {"id": completion_id, "object": "text_completion", "created": created, "model": generator.model_name,
               "choices": [], "usage": usage(last)}
