"""POST /v1/completions (legacy text completions): a prompt string or token ids, streamed or not;
OpenAI's completions dialect over the generation core."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway import core, tracing
from gateway.core import LENGTH, Finish, GenerationRequest, PromptLogprobs, Text, Usage
from gateway.errors import InvalidRequest
from gateway.generation import Generator, now_s
from gateway.logprobs import completion_logprobs
from gateway.model_registry import ModelRegistry
from gateway.routes.common import (
    documented,
    event_stream,
    json_response,
    openai_usage,
)
from gateway.schemas import Completion, CompletionChoice, CompletionRequest
from gateway.validation import check_supported, check_token_ids, request_id, response_guide, stop_strings

MAX_PROMPTS = 64
MAX_BEST_OF = 16


def _prompt_ids(generator: Generator, prompt: object) -> list[list[int]]:
    """``prompt`` as token ids, one list per prompt: a string, strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):  # bools too: refused below
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
        else:
            out.append(check_token_ids(list(p), generator.vocab_size, "prompt"))
    return out


def _prompt_chars(prompt: object) -> list[int]:
    """The characters of each prompt string (token ids are counted when the request is built)."""
    if isinstance(prompt, str):
        return [len(prompt)]
    return [len(p) for p in prompt if isinstance(p, str)] if isinstance(prompt, list) else []


class CompletionsController(Controller):
    path = "/v1/completions"

    @post("/", status_code=200, responses=documented(Completion, "the completion (with `stream`: text_completion chunks)"))
    async def create(self, request: Request, data: JSONBody[CompletionRequest], models: NamedDependency[ModelRegistry]) -> Response:
        req = data
        generator = models.get(req.model)
        check_supported(req)
        stops = stop_strings(req.stop)
        copies = _copies(req)
        logprobs = req.logprobs_count()
        guide = response_guide(req.response_format)
        chars = _prompt_chars(req.prompt)
        generator.check_prompt_size(max(chars, default=0), param="prompt")
        with tracing.span("tokenize"):
            prompts = await generator.run_in_pool(_prompt_ids, generator, req.prompt, size=sum(chars))
        budget = req.max_tokens if req.max_tokens is not None else 16
        if _prompt_only(req):  # score the prompt, generate nothing: the one token the worker makes is dropped
            budget = 1
        generation = await core.start(
            generator,
            GenerationRequest(
                prompts=prompts,
                sampling=req,
                max_tokens=budget,
                request_id=request_id(request.headers.get("x-request-id")),
                stops=stops,
                guide=guide,
                n=copies,
                n_param="n" if req.best_of is None else "best_of",
                logprobs=0 if copies > req.n and logprobs is None else logprobs,  # ranking by cumulative logprob needs them
                prompt_logprobs=req.logprobs if req.echo else None,  # the echoed prompt comes with its logprobs
            ),
            request,
        )
        echoes = await generator.run_in_pool(_echo_texts, generator, req.prompt, prompts) if req.echo else None
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return event_stream(_chunks(generator, generation, completion_id, req, echoes), generation.request_id)
        choices = await generation.collect(request)
        return json_response(_body(generator, completion_id, choices, req, echoes), generation.request_id)


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


def _best(choices: list[core.Choice], copies: int, n: int) -> list[core.Choice]:
    """Of each prompt's ``copies`` generations, the ``n`` with the highest cumulative logprob."""
    if copies == n:
        return choices
    best = []
    for start in range(0, len(choices), copies):
        group = choices[start : start + copies]
        best.extend(sorted(group, key=lambda c: -sum(lp.logprob for _, lp in c.logprobs))[:n])
    return best


def _finish_reason(finish: Finish) -> str:
    return "length" if finish.reason == LENGTH else "stop"


def _body(generator: Generator, completion_id: str, choices: list[core.Choice], req: CompletionRequest, echoes: list[str] | None) -> Completion:
    with_logprobs = req.logprobs_count() is not None
    copies = _copies(req)
    finishes: list[Finish] = [c.finish for c in choices]  # type: ignore[misc]
    chosen = _best(choices, copies, req.n)
    if _prompt_only(req):  # the one generated token is not part of the answer
        chosen = [core.Choice(c.index, prompt_logprobs=c.prompt_logprobs, finish=Finish(c.index, LENGTH, Usage())) for c in chosen]
        finishes = [Finish(f.index, LENGTH, Usage(f.usage.prompt_tokens, 0, f.usage.cached_tokens)) for f in finishes]
    out = [
        CompletionChoice(
            index=index,
            text=(echoes[index // req.n] if echoes else "") + choice.text,
            logprobs=completion_logprobs(generator.token_texts, choice.prompt_logprobs + choice.logprobs) if with_logprobs else None,
            finish_reason=_finish_reason(choice.finish),  # type: ignore[arg-type]
        )
        for index, choice in enumerate(chosen)
    ]
    usage = core.total_usage(finishes, copies)  # every generation was computed, so every one counts
    return Completion(id=completion_id, created=now_s(), model=generator.model_name, choices=out, usage=openai_usage(usage))


async def _chunks(
    generator: Generator,
    generation: core.Generation,
    completion_id: str,
    req: CompletionRequest,
    echoes: list[str] | None,
) -> AsyncIterator[Completion]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    with_logprobs = req.logprobs_count() is not None
    created = now_s()
    offsets = [0] * generation.choices  # where each choice's next text starts, for text_offset

    def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> Completion:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return Completion(
            id=completion_id, created=created, model=generator.model_name, choices=[choice], usage=None if include_usage else msgspec.UNSET
        )

    def echo(index: int, prompt_logprobs: list) -> Completion:
        text = echoes[index // req.n]  # type: ignore[index]
        offsets[index] = len(text)
        return chunk(index, text, completion_logprobs(generator.token_texts, prompt_logprobs) if with_logprobs else None)

    # The echo goes first; with logprobs it waits for them (they come with the first token).
    for index in range(generation.choices if echoes and not with_logprobs else 0):
        yield echo(index, [])
    finishes: dict[int, Finish] = {}
    async for event in generation.events():
        if isinstance(event, PromptLogprobs):
            if echoes and with_logprobs:
                yield echo(event.index, event.logprobs)
        elif isinstance(event, Text):
            logprobs = completion_logprobs(generator.token_texts, event.logprobs, offsets[event.index]) if with_logprobs else None
            offsets[event.index] += len(event.text)
            yield chunk(event.index, event.text, logprobs)
        elif isinstance(event, Finish):
            finishes[event.index] = event
            yield chunk(event.index, "", None, _finish_reason(event))
    if include_usage and len(finishes) == generation.choices:
        usage = core.total_usage([finishes[i] for i in range(generation.choices)], req.n)
        yield Completion(id=completion_id, created=created, model=generator.model_name, choices=[], usage=openai_usage(usage))
