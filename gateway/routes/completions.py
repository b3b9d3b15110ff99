"""POST /v1/completions (legacy text completions): a prompt string or token ids, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Controller, Request, Response, post

from common.protocol import NewRequest
from gateway.admission import Slot
from gateway.errors import InvalidRequest
from gateway.generation import Generator, TextDelta, now_s
from gateway.routes.common import check_model, respond, usage
from gateway.schemas import CompletionRequest, decode_body
from gateway.validation import check_supported, new_request, request_id, stop_strings


class CompletionsController(Controller):
    path = "/v1/completions"

    @post("/", status_code=200)
    async def create(self, request: Request, generator: Generator) -> Response:
        req = decode_body(await request.body(), CompletionRequest)
        check_model(req.model, generator.model_name)
        check_supported(req)
        stops = stop_strings(req)
        if req.echo:
            raise InvalidRequest("`echo` is not supported yet", param="echo")
        limits = generator.client.limits()
        if isinstance(req.prompt, str):
            prompt_ids = await generator.run_in_pool(generator.text_prompt_ids, req.prompt)
        else:
            prompt_ids = req.prompt
        new = new_request(
            req, prompt_ids, req.max_tokens if req.max_tokens is not None else 16, "max_tokens", limits,
            request_id(request.headers.get("x-request-id")), generator.vocab_size,
        )
        return await respond(request, generator, req, new, stops, "cmpl", _chunks, _body)


def _body(generator: Generator, completion_id: str, result: TextDelta) -> dict:
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": now_s(),
        "model": generator.model_name,
        "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": usage(result),
    }


async def _chunks(
    generator: Generator, new: NewRequest, slot: Slot, stops: list[str], completion_id: str, include_usage: bool,
    skip_special_tokens: bool,
) -> AsyncIterator[dict]:
    created = now_s()
    last = None
    async for delta in generator.stream(new, slot, stops, skip_special_tokens):
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
