"""POST /v1/completions (legacy text completions): a prompt string or token ids, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from functools import partial

from litestar import Controller, Request, Response, post

from gateway.errors import InvalidRequest
from gateway.generation import Generator, TextDelta, now_s
from gateway.logprobs import completion_logprobs
from gateway.routes.common import Chunks, check_model, respond, usage
from gateway.schemas import CompletionRequest, decode_body
from gateway.validation import check_supported, new_request, request_id, stop_strings


MAX_PROMPTS = 64
MAX_BEST_OF = 16


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
        copies = _copies(req)
        limits = generator.client.limits()
        prompts = await generator.run_in_pool(_prompt_ids, generator, req.prompt)
        rid = request_id(request.headers.get("x-request-id"))
        budget = req.max_tokens if req.max_tokens is not None else 16
        if _prompt_only(req):  # score the prompt, generate nothing: the one token the worker makes is dropped
            budget = 1
        news = [
            new_request(req, ids, budget, "max_tokens", limits, f"{rid}-p{p}" if len(prompts) > 1 else rid, generator.vocab_size, choice)
            for p, ids in enumerate(prompts)
            for choice in range(copies)
        ]
        for new in news:
            if copies > req.n and new.sampling.logprobs is None:  # ranking by cumulative logprob needs them
                new.sampling.logprobs = 0
            if req.echo and req.logprobs is not None:  # the echoed prompt comes with its logprobs
                new.sampling.prompt_logprobs = req.logprobs
        echoes = await generator.run_in_pool(_echo_texts, generator, req.prompt, prompts) if req.echo else None
        return await respond(request, generator, req, news, stops, "cmpl", partial(_chunks, echoes=echoes), partial(_body, echoes=echoes))


def _prompt_only(req: CompletionRequest) -> bool:
    """``max_tokens: 0`` with ``echo``: the prompt's logprobs alone (how lm-eval scores log-likelihoods)."""
    if req.max_tokens != 0:
        return False
    if not req.echo or req.stream:
        raise InvalidRequest("`max_tokens` 0 is only allowed with `echo` (and without streaming)", param="max_tokens")
    return True


def _copies(req: CompletionRequest) -> int:
    """Generations per prompt: ``best_of`` when given (the best ``n`` are returned), else ``n``."""
    if req.best_of is None:
        return req.n
    if not req.n <= req.best_of <= MAX_BEST_OF:
        raise InvalidRequest(f"`best_of` must be between `n` ({req.n}) and {MAX_BEST_OF}; got {req.best_of}", param="best_of")
    if req.stream and req.best_of > req.n:
        raise InvalidRequest("`best_of` larger than `n` cannot be streamed (the best are known only at the end)", param="best_of")
    return req.best_of


def _echo_texts(generator: Generator, prompt: object, prompts: list[list[int]]) -> list[str]:
    """Each prompt as the client gave it: its own string, or its token ids decoded."""
    single = isinstance(prompt, str) or all(isinstance(t, int) for t in prompt)  # type: ignore[union-attr]
    given = [prompt] if single else list(prompt)  # type: ignore[call-overload]
    return [p if isinstance(p, str) else generator.tokenizer.decode(ids) for p, ids in zip(given, prompts)]


def _best(results: list[TextDelta], copies: int, n: int) -> list[TextDelta]:
    """Of each prompt's ``copies`` generations, the ``n`` with the highest cumulative logprob."""
    if copies == n:
        return results
    best = []
    for start in range(0, len(results), copies):
        group = results[start : start + copies]
        best.extend(sorted(group, key=lambda d: -sum(lp.logprob for _, lp in d.logprobs))[:n])
    return best


def _body(generator: Generator, completion_id: str, results: list[TextDelta], req: CompletionRequest, echoes: list[str] | None = None) -> dict:
    with_logprobs = req.logprobs_count() is not None
    copies = _copies(req)
    chosen = _best(results, copies, req.n)
    if _prompt_only(req):
        results = chosen = [replace(r, text="", logprobs=[], completion_tokens=0, finish_reason="length") for r in chosen]
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": now_s(),
        "model": generator.model_name,
        "choices": [
            {
                "index": index,
                "text": (echoes[index // req.n] if echoes else "") + result.text,
                "logprobs": completion_logprobs(generator.token_texts, result.prompt_logprobs + result.logprobs) if with_logprobs else None,
                "finish_reason": result.finish_reason,
            }
            for index, result in enumerate(chosen)
        ],
        "usage": usage(results, copies),  # every generation was computed, so every one counts
    }


async def _chunks(
    generator: Generator, deltas: AsyncIterator[tuple[int, TextDelta]], completion_id: str, include_usage: bool,
    choices: int, req: CompletionRequest, echoes: list[str] | None = None,
) -> AsyncIterator[dict]:
    make = Chunks(generator, completion_id, "text_completion", include_usage)
    with_logprobs = req.logprobs_count() is not None
    offsets = [0] * choices  # where each choice's next text starts, for text_offset

    def echo(index: int, prompt_logprobs: list) -> dict:
        text = echoes[index // req.n]  # type: ignore[index]
        logprobs = completion_logprobs(generator.token_texts, prompt_logprobs) if with_logprobs else None
        offsets[index] = len(text)
        return make({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})

    # The echo goes first; with logprobs it waits for them (they come with the first token).
    for index in range(choices if echoes and not with_logprobs else 0):
        yield echo(index, [])
    async for index, delta in deltas:
        make.last[index] = delta
        if echoes and with_logprobs and delta.prompt_logprobs:
            yield echo(index, delta.prompt_logprobs)
        if delta.text or delta.finish_reason is not None or (with_logprobs and delta.logprobs):
            logprobs = completion_logprobs(generator.token_texts, delta.logprobs, offsets[index]) if with_logprobs else None
            offsets[index] += len(delta.text)
            yield make({"index": index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason})
    if (final := make.usage_chunk(choices, req.n)) is not None:
        yield final
