"""POST /v1/completions (legacy text completions): a prompt string or token ids, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Controller, Request, Response, post

from gateway.errors import InvalidRequest
from gateway.generation import Generator, TextDelta, now_s
from gateway.logprobs import completion_logprobs
from gateway.routes.common import Chunks, check_model, respond, usage
from gateway.schemas import CompletionRequest, decode_body
from gateway.validation import check_supported, new_request, request_id, stop_strings


MAX_PROMPTS = 64


def _prompt_ids(generator: Generator, prompt: object) -> list[list[int]]:
    """``prompt`` as token ids, one list per prompt: a string, strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequest("`prompt` must be a string, a list of strings, token ids, or a list of token-id lists", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequest(f"`prompt` may hold at most {MAX_PROMPTS} prompts; got {len(prompts)}", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            out.append(generator.text_prompt_ids(p))
        elif all(isinstance(t, int) and 0 <= t < generator.vocab_size for t in p):
            out.append(list(p))
        else:
            raise InvalidRequest(f"`prompt` token ids must be integers from 0 to {generator.vocab_size - 1}", param="prompt")
    return out


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
        prompts = await generator.run_in_pool(_prompt_ids, generator, req.prompt)
        rid = request_id(request.headers.get("x-request-id"))
        budget = req.max_tokens if req.max_tokens is not None else 16
        news = [
            new_request(req, ids, budget, "max_tokens", limits, f"{rid}-p{p}" if len(prompts) > 1 else rid, generator.vocab_size, choice)
            for p, ids in enumerate(prompts)
            for choice in range(req.n)
        ]
        return await respond(request, generator, req, news, stops, "cmpl", _chunks, _body)


def _body(generator: Generator, completion_id: str, results: list[TextDelta], req: CompletionRequest) -> dict:
    with_logprobs = req.logprobs_count() is not None
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": now_s(),
        "model": generator.model_name,
        "choices": [
            {
                "index": index,
                "text": result.text,
                "logprobs": completion_logprobs(generator.token_texts, result.logprobs) if with_logprobs else None,
                "finish_reason": result.finish_reason,
            }
            for index, result in enumerate(results)
        ],
        "usage": usage(results, req.n),
    }


async def _chunks(
    generator: Generator, deltas: AsyncIterator[tuple[int, TextDelta]], completion_id: str, include_usage: bool,
    choices: int, req: CompletionRequest,
) -> AsyncIterator[dict]:
    make = Chunks(generator, completion_id, "text_completion", include_usage)
    with_logprobs = req.logprobs_count() is not None
    offsets = [0] * choices  # where each choice's next text starts, for text_offset
    async for index, delta in deltas:
        make.last[index] = delta
        if delta.text or delta.finish_reason is not None or (with_logprobs and delta.logprobs):
            logprobs = completion_logprobs(generator.token_texts, delta.logprobs, offsets[index]) if with_logprobs else None
            offsets[index] += len(delta.text)
            yield make({"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason})
    if (final := make.usage_chunk(choices, req.n)) is not None:
        yield final
