"""vLLM's token-in/token-out endpoints, by its names and shapes, so llmpool can sit behind a router
that renders and derenders itself (llm-d, Dynamo): POST /v1/chat/completions/render and
/v1/completions/render (a request into the token ids generate takes), /inference/v1/generate (token
ids in, token ids and logprobs out, streamed or not), /v1/chat/completions/derender and
/v1/completions/derender (token ids back into OpenAI's answers), and /abort_requests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.errors import InvalidRequest
from gateway.generate import core
from gateway.generate.events import Usage
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest, request_id
from gateway.generate.served_model import ServedModel, TextDelta, now_s
from gateway.generate.validation import check_token_ids
from gateway.http.routes import chat, completions
from gateway.http.routes.common import documented, event_stream, json_response, openai_usage
from gateway.http.routes.tokens_parse import chat_reader
from gateway.policy.caller import Caller
from gateway.schemas.chat import ChatCompletionRequest, CompletionRequest
from gateway.schemas.tokens import (
    AbortRequest,
    DerenderChatRequest,
    DerenderCompletionRequest,
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
)
from gateway.state.aborts import Aborts
from gateway.state.service import StateService

# Generate requests in flight on this gateway, by the id the client gave: /abort_requests sets their event.
_RUNNING: dict[str, asyncio.Event] = {}
_SAMPLING = (
    "n temperature top_p top_k min_p seed stop stop_token_ids presence_penalty frequency_penalty "
    "repetition_penalty ignore_eos min_tokens skip_special_tokens logit_bias"
).split()


def _rendered(served: ServedModel, ids: list[int], data: Any, max_tokens: int | None, prefix: str) -> dict:
    """One prompt as vLLM's GenerateRequest (what /inference/v1/generate takes), plus its text."""
    room = (served.max_model_len() or len(ids)) - len(ids)
    sampling = {name: getattr(data, name) for name in _SAMPLING if getattr(data, name, None) is not None}
    sampling["max_tokens"] = max_tokens if max_tokens is not None else room
    logprobs = data.logprobs
    if logprobs is not None and logprobs is not False:  # chat's bool and top_logprobs, or completions' int
        sampling["logprobs"] = (data.top_logprobs or 0) if logprobs is True else logprobs
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": sampling,
        "model": data.model,
        "stream": data.stream,
        "stream_options": data.stream_options if data.stream else None,
        "cache_salt": None,
        "priority": data.priority or 0,
        "kv_transfer_params": None,
        "prompt": served.tokenizer.decode(ids, skip_special_tokens=False),
    }


async def abort_beat(aborts: Aborts) -> None:
    """A heartbeat's share: the generate requests other gateways were asked to stop, stopped here."""
    for ident in await aborts.new():
        if ident in _RUNNING:
            _RUNNING[ident].set()


class TokensController(Controller):
    path = "/"

    @post("/v1/chat/completions/render", status_code=200, responses=documented(None))
    async def render_chat(
        self,
        data: JSONBody[ChatCompletionRequest],
        models: NamedDependency[ModelRegistry],
        caller: NamedDependency[Caller],
    ) -> Response:
        """The prompt token ids (and text) a chat request becomes: the same template, tools and checks as chat."""
        served, req = models.get(data.model), chat.core_request(data)
        (ids,) = await core.prompt_ids(served, req, caller)
        body = await served.run_in_pool(_rendered, served, ids, data, req.max_tokens, "chatcmpl", size=len(ids))
        return json_response(body)

    @post("/v1/completions/render", status_code=200, responses=documented(None))
    async def render_completion(
        self, data: JSONBody[CompletionRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
    ) -> Response:
        served, req = models.get(data.model), completions.core_request(data)
        prompts = await core.prompt_ids(served, req, caller)
        return json_response([_rendered(served, ids, data, data.max_tokens, "cmpl") for ids in prompts])

    @post("/inference/v1/generate", status_code=200, responses=documented(GenerateResponse))
    async def generate(
        self, data: JSONBody[GenerateRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
    ) -> Response:
        served = models.get(data.model)
        if data.features:
            raise InvalidRequest("multimodal `features` are not supported: the models served are text-only", "features")
        sampling = data.sampling_params
        sampling.skip_special_tokens = False  # token ids out: every token, the end-of-sequence one too
        if data.priority and sampling.priority is None:
            sampling.priority = data.priority
        check_token_ids(data.token_ids, served.vocab_size, "token_ids")
        client_id = data.request_id or uuid.uuid4().hex
        req = CoreRequest(
            sampling=sampling,
            prompts=[data.token_ids],
            max_tokens=sampling.max_tokens,
            max_tokens_param="sampling_params.max_tokens",
            stop=sampling.stop,
            n=sampling.n,
            logprobs=sampling.logprobs,
            logprobs_param="sampling_params.logprobs",
            request_id=request_id(client_id),
            cache_salt=data.cache_salt,
        )
        generation = await core.start(served, req, caller)
        stopped = _RUNNING.setdefault(client_id, asyncio.Event())
        outputs = _until(generation.outputs(), stopped)
        if data.stream:
            return event_stream(_chunks(outputs, data, client_id), generation.request_id)
        try:
            body = await _collect(outputs, generation.choices, data, client_id)
        finally:
            _RUNNING.pop(client_id, None)
        return json_response(body, generation.request_id)

    @post("/abort_requests", status_code=200, responses=documented(None))
    async def abort_requests(self, data: JSONBody[AbortRequest], stored: NamedDependency[StateService]) -> Response:
        """Stop generate requests by their ids (``finish_reason: abort``): those running here now, the
        others at the next heartbeat of the gateway running them (gateway/state/aborts.py). The answer
        names both (vLLM's body is empty; a JSON object keeps the route's documented type)."""
        found = [ident for ident in data.request_ids if ident in _RUNNING]
        for ident in found:
            _RUNNING[ident].set()
        elsewhere = [ident for ident in data.request_ids if ident not in _RUNNING]
        if elsewhere:
            await stored.aborts.post(elsewhere)
        return Response(content={"aborted": found, "passed_on": elsewhere}, status_code=200)

    @post("/v1/chat/completions/derender", status_code=200, responses=documented(None))
    async def derender_chat(
        self, data: JSONBody[DerenderChatRequest], models: NamedDependency[ModelRegistry]
    ) -> Response:
        served, gen = models.get(data.model), data.generate_response
        read = await chat_reader(served, data.chat_request)  # its tool calls and thinking, as chat reads them
        choices, completion = [], 0
        for i, choice in enumerate(gen.choices):
            ids = _output_ids(served, choice, f"generate_response.choices[{i}].token_ids")
            completion += len(ids)
            text = await served.run_in_pool(served.tokenizer.decode, ids, True, size=len(ids))
            message, finish = {"role": "assistant", "content": text}, choice.finish_reason
            if read is not None:
                message, finish = read(choice.index, text, finish)
            logprobs = _resolved(served, choice.logprobs)
            choices.append({"index": choice.index, "message": message, "finish_reason": finish, "logprobs": logprobs})
        body = {
            "id": gen.request_id,
            "object": "chat.completion",
            "created": now_s(),
            "model": served.served_name,
            "choices": choices,
            "usage": openai_usage(Usage(data.prompt_tokens, completion)),
            "prompt_logprobs": gen.prompt_logprobs,
            "kv_transfer_params": gen.kv_transfer_params,
        }
        return json_response(body)

    @post("/v1/completions/derender", status_code=200, responses=documented(None))
    async def derender_completion(
        self, data: JSONBody[DerenderCompletionRequest], models: NamedDependency[ModelRegistry]
    ) -> Response:
        served, responses = models.get(data.model), data.generate_responses
        if not responses:
            raise InvalidRequest("`generate_responses` must hold at least one response", param="generate_responses")
        prompt_tokens = data.prompt_tokens or [0] * len(responses)
        if len(prompt_tokens) != len(responses):
            raise InvalidRequest("`prompt_tokens` must hold one count per generate response", param="prompt_tokens")
        choices, completion = [], 0
        for r, gen in enumerate(responses):
            for i, choice in enumerate(gen.choices):
                ids = _output_ids(served, choice, f"generate_responses[{r}].choices[{i}].token_ids")
                completion += len(ids)
                text = served.tokenizer.decode(ids, skip_special_tokens=True)
                choices.append(
                    {
                        "index": len(choices),
                        "text": text,
                        "finish_reason": choice.finish_reason,
                        "logprobs": _flat(served, choice.logprobs),
                    }
                )
        body = {
            "id": responses[0].request_id,
            "object": "text_completion",
            "created": now_s(),
            "model": served.served_name,
            "choices": choices,
            "usage": openai_usage(Usage(sum(prompt_tokens), completion)),
            "kv_transfer_params": responses[0].kv_transfer_params,
        }
        return json_response(body)


async def _until(outputs: AsyncIterator[tuple[int, TextDelta]], stopped: asyncio.Event) -> AsyncIterator[Any]:
    """The outputs until ``stopped`` is set; then None once (the generation is closed, which aborts
    it on the worker)."""
    waiter = asyncio.ensure_future(stopped.wait())
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                yield None
                return
            try:
                yield step.result()
            except StopAsyncIteration:
                return
    finally:
        waiter.cancel()
        await outputs.aclose()


def _logprobs(delta: TextDelta) -> dict | None:
    """Chat's logprobs shape with tokens named by id (``token_id:N``), as vLLM's generate names them."""
    if not delta.logprobs:
        return None
    content = []
    for token_id, lp in delta.logprobs:
        top = [{"token": f"token_id:{t}", "logprob": v, "bytes": None} for t, v in zip(lp.top_ids, lp.top_logprobs)]
        content.append({"token": f"token_id:{token_id}", "logprob": lp.logprob, "bytes": None, "top_logprobs": top})
    return {"content": content}


def _usage(finishes: dict[int, TextDelta]) -> dict:
    first = finishes.get(0)
    prompt = first.prompt_tokens if first is not None else 0
    completion = sum(d.completion_tokens for d in finishes.values())
    cached = first.cached_tokens if first is not None else 0
    details = {"cached_tokens": cached}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    }


async def _collect(outputs: AsyncIterator[Any], count: int, data: GenerateRequest, client_id: str) -> GenerateResponse:
    choices = [GenerateChoice(index=i, token_ids=[]) for i in range(count)]
    finishes: dict[int, TextDelta] = {}
    async for item in outputs:
        if item is None:  # aborted: what was made so far
            for choice in choices:
                choice.finish_reason = choice.finish_reason or "abort"
            break
        index, delta = item
        choice = choices[index]
        choice.token_ids.extend(delta.token_ids)
        if (lp := _logprobs(delta)) is not None:
            choice.logprobs = {"content": [*(choice.logprobs or {"content": []})["content"], *lp["content"]]}
        if delta.finish_reason is not None:
            choice.finish_reason, finishes[index] = delta.finish_reason, delta
    return GenerateResponse(
        request_id=client_id, choices=choices, kv_transfer_params=data.kv_transfer_params, usage=_usage(finishes)
    )


async def _chunks(
    outputs: AsyncIterator[Any], data: GenerateRequest, client_id: str
) -> AsyncIterator[GenerateResponse]:
    """One GenerateResponse per output, each with the new token ids; usage last when asked for."""
    finishes: dict[int, TextDelta] = {}
    try:
        async for item in outputs:
            if item is None:
                yield GenerateResponse(
                    request_id=client_id, choices=[GenerateChoice(index=0, token_ids=[], finish_reason="abort")]
                )
                return
            index, delta = item
            if delta.finish_reason is not None:
                finishes[index] = delta
            choice = GenerateChoice(
                index=index, token_ids=delta.token_ids, finish_reason=delta.finish_reason, logprobs=_logprobs(delta)
            )
            yield GenerateResponse(request_id=client_id, choices=[choice], kv_transfer_params=data.kv_transfer_params)
        if data.stream_options is not None and data.stream_options.include_usage:
            yield GenerateResponse(request_id=client_id, choices=[], usage=_usage(finishes))
    finally:
        _RUNNING.pop(client_id, None)


def _output_ids(served: ServedModel, choice: GenerateChoice, param: str) -> list[int]:
    if not choice.token_ids:
        raise InvalidRequest(f"`{param}` must hold the generated token ids", param=param)
    return check_token_ids(choice.token_ids, served.vocab_size, param)


def _token_id(token: str) -> int | None:
    return int(token[9:]) if token.startswith("token_id:") and token[9:].isdigit() else None


def _entry(served: ServedModel, entry: dict) -> dict:
    """A logprob entry with its ``token_id:N`` name resolved to the token's text and bytes."""
    token_id = _token_id(str(entry.get("token", "")))
    if token_id is None or not 0 <= token_id < served.vocab_size:
        return entry
    return {**entry, **served.token_texts.entry(token_id, entry.get("logprob", 0.0))}


def _resolved(served: ServedModel, logprobs: dict | None) -> dict | None:
    if not logprobs or not isinstance(logprobs.get("content"), list):
        return logprobs
    content = []
    for entry in logprobs["content"]:
        resolved = _entry(served, entry)
        resolved["top_logprobs"] = [_entry(served, t) for t in entry.get("top_logprobs") or []]
        content.append(resolved)
    return {"content": content, "refusal": None}


def _flat(served: ServedModel, logprobs: dict | None) -> dict | None:
    """Chat-shaped logprobs as legacy completions' flat lists."""
    resolved = _resolved(served, logprobs)
    if resolved is None:
        return None
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for entry in resolved["content"]:
        result["tokens"].append(entry["token"])
        result["token_logprobs"].append(entry["logprob"])
        result["top_logprobs"].append({t["token"]: t["logprob"] for t in entry.get("top_logprobs", [])})
        result["text_offset"].append(offset)
        offset += len(entry["token"])
    return result
