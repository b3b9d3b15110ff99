"""POST /v1/completions (legacy text completions): a prompt string or token ids, streamed or not;
OpenAI's completions dialect over the generation core."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import partial

import msgspec
from litestar import Controller, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.errors import InvalidRequest
from gateway.generate import core, events
from gateway.generate.events import LENGTH, Finish, PromptLogprobs, Text, Usage
from gateway.generate.logprobs import completion_logprobs
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest
from gateway.generate.served_model import now_s
from gateway.generate.structured_outputs import format_param, output_format
from gateway.http.routes.common import answer, documented, openai_usage
from gateway.http.routes.stream_runs import DIALECTS, Dialect, StreamId, start_stream
from gateway.policy.caller import Caller
from gateway.schemas.chat import Completion, CompletionChoice, CompletionRequest
from gateway.state.service import StateService

MAX_BEST_OF = 16


def core_request(data: CompletionRequest) -> CoreRequest:
    """The body in the core's terms; only the completions dialect's own shapes are checked here."""
    if data.suffix is not None:  # insertion needs a fill-in-the-middle model and its prompt format
        raise InvalidRequest("`suffix` is not supported by this server", param="suffix")
    copies = _copies(data)
    budget = data.max_tokens if data.max_tokens is not None else 16
    return CoreRequest(
        sampling=data,
        prompts=_prompts(data.prompt),
        max_tokens=1 if _prompt_only(data) else budget,  # scoring the prompt: the one token made is dropped
        stop=data.stop,
        response_format=output_format(data),
        format_param=format_param(data),
        n=copies,
        n_param="n" if data.best_of is None else "best_of",
        logprobs=0
        if copies > data.n and data.logprobs is None
        else data.logprobs,  # ranking by cumulative logprob needs them
        prompt_logprobs=data.logprobs if data.echo else None,  # the echoed prompt comes with its logprobs
    )


def _prompts(prompt: object) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, strings, token ids, or lists of them."""
    if isinstance(prompt, str):
        return [prompt]
    if (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):  # bools too: the core refuses them
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    raise InvalidRequest(
        "`prompt` must be a string, a list of strings, token ids, or a list of token-id lists", param="prompt"
    )


class CompletionsController(Controller):
    path = "/v1/completions"

    @post(
        "/", status_code=200, responses=documented(Completion, "the completion (with `stream`: text_completion chunks)")
    )
    async def create(
        self,
        request: Request,
        data: JSONBody[CompletionRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
        stored: NamedDependency[StateService],
    ) -> Response:
        started = await start_stream(request, "completions", data, core_request(data), models, caller, stored)
        if isinstance(started, Response):  # a reconnecting client's rest, or a logged stream
            return started
        generation, ident = started
        echoes = await generation.served.run_in_pool(_echo_texts, generation, data.prompt) if data.echo else None
        return await answer(
            caller,
            generation,
            data.stream,
            partial(_chunks, generation, data, ident, echoes),
            partial(_body, generation, data, echoes),
            ident.id,
        )


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
        raise InvalidRequest(
            f"`best_of` must be between `n` ({req.n}) and {MAX_BEST_OF}; got {req.best_of}", param="best_of"
        )
    if req.stream and req.best_of > req.n:
        raise InvalidRequest(
            "`best_of` larger than `n` cannot be streamed (the best are known only at the end)", param="best_of"
        )
    return req.best_of


def _echo_texts(generation: core.Generation, prompt: object) -> list[str]:
    """Each prompt as the client gave it: its own string, or its token ids decoded."""
    decode = generation.served.tokenizer.decode
    return [p if isinstance(p, str) else decode(ids) for p, ids in zip(_prompts(prompt), generation.prompts)]


def _best(choices: list[events.Choice], copies: int, n: int) -> list[events.Choice]:
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


def _body(
    generation: core.Generation, req: CompletionRequest, echoes: list[str] | None, choices: list[events.Choice]
) -> Completion:
    served, with_logprobs = generation.served, req.logprobs is not None
    copies = _copies(req)
    finishes: list[Finish] = [c.finish for c in choices]  # type: ignore[misc]
    chosen = _best(choices, copies, req.n)
    if _prompt_only(req):  # the one generated token is not part of the answer
        chosen = [
            events.Choice(c.index, prompt_logprobs=c.prompt_logprobs, finish=Finish(c.index, LENGTH, Usage()))
            for c in chosen
        ]
        finishes = [Finish(f.index, LENGTH, Usage(f.usage.prompt_tokens, 0, f.usage.cached_tokens)) for f in finishes]
    out = [
        CompletionChoice(
            index=index,
            text=(echoes[index // req.n] if echoes else "") + choice.text,
            logprobs=completion_logprobs(served.token_texts, choice.prompt_logprobs + choice.logprobs)
            if with_logprobs
            else None,
            finish_reason=_finish_reason(choice.finish),  # type: ignore[arg-type]
        )
        for index, choice in enumerate(chosen)
    ]
    usage = events.total_usage(finishes, copies)  # every generation was computed, so every one counts
    return Completion(
        id=f"cmpl-{uuid.uuid4().hex}",
        created=now_s(),
        model=served.served_name,
        choices=out,
        usage=openai_usage(usage),
    )


async def _logged_chunks(
    generation: core.Generation, req: CompletionRequest, ident: StreamId
) -> AsyncIterator[Completion]:
    echoes = await generation.served.run_in_pool(_echo_texts, generation, req.prompt) if req.echo else None
    async for chunk in _chunks(generation, req, ident, echoes):
        yield chunk


async def _chunks(
    generation: core.Generation, req: CompletionRequest, ident: StreamId, echoes: list[str] | None
) -> AsyncIterator[Completion]:
    served, completion_id, created = generation.served, ident.id, ident.created
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    with_logprobs = req.logprobs is not None
    offsets = [0] * generation.choices  # where each choice's next text starts, for text_offset

    def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> Completion:
        choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish_reason)
        return Completion(
            id=completion_id,
            created=created,
            model=served.served_name,
            choices=[choice],
            usage=None if include_usage else msgspec.UNSET,
        )

    def echo(index: int, prompt_logprobs: list) -> Completion:
        text = echoes[index // req.n]  # type: ignore[index]
        offsets[index] = len(text)
        return chunk(index, text, completion_logprobs(served.token_texts, prompt_logprobs) if with_logprobs else None)

    # The echo goes first; with logprobs it waits for them (they come with the first token).
    for index in range(generation.choices if echoes and not with_logprobs else 0):
        yield echo(index, [])
    finishes: dict[int, Finish] = {}
    async for event in generation.events():
        if isinstance(event, PromptLogprobs):
            if echoes and with_logprobs:
                yield echo(event.index, event.logprobs)
        elif isinstance(event, Text):
            logprobs = (
                completion_logprobs(served.token_texts, event.logprobs, offsets[event.index]) if with_logprobs else None
            )
            offsets[event.index] += len(event.text)
            yield chunk(event.index, event.text, logprobs)
        elif isinstance(event, Finish):
            finishes[event.index] = event
            yield chunk(event.index, "", None, _finish_reason(event))
    if include_usage and len(finishes) == generation.choices:
        usage = events.total_usage([finishes[i] for i in range(generation.choices)], req.n)
        yield Completion(
            id=completion_id, created=created, model=served.served_name, choices=[], usage=openai_usage(usage)
        )


DIALECTS["completions"] = Dialect(CompletionRequest, core_request, _logged_chunks, "cmpl-")
