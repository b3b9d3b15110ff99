"""The pooling core every pooling endpoint (embeddings, rerank, score) speaks through, as the
generation core is for the generating dialects: what a model can do, the inputs checked and
tokenized, admitted, sent (one wire request per input), and their vectors back.

Each input takes one admission slot while it runs, as a generation does; a request with more
inputs than there are slots runs in waves, so a client's batch of 1,000 chunks (LangChain's
default) is served, not refused. Metrics, tracing, the deadline and the abort on a hang-up are
the generation's: each input is a wire request with its own span and clock.
"""

from __future__ import annotations

import asyncio
from array import array
from dataclasses import dataclass, field

from common.pooling import PoolingParams
from common.protocol import NewRequest, RequestOutput
from gateway.errors import GenerationFailed, InvalidRequest, RequestTimeout
from gateway.generate.core import admit
from gateway.generate.lanes import unless_disconnected
from gateway.generate.request import request_id
from gateway.generate.served_model import ServedModel
from gateway.generate.validation import check_token_ids
from gateway.ops import tracing
from gateway.ops.metrics import RequestClock
from gateway.policy.admission import Slot
from gateway.policy.caller import Caller
from gateway.policy.priority import request_priority

MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


@dataclass(slots=True)
class Input:
    """One text (or pair of texts) to pool, or token ids as given."""

    text: str | None = None
    pair: str | None = None  # a cross-encoder's document: tokenized with ``text`` as one sequence
    ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Pooled:
    vector: array  # float32
    prompt_tokens: int


def inputs_of(value: object, param: str, vocab_size: int) -> list[Input]:
    """OpenAI's input shapes (a text, texts, token ids, lists of token ids) as Inputs."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(
            f"`{param}` must be a non-empty string, list of strings, or list of token-id lists", param=param
        )
    if all(type(v) is int for v in value):
        value = [value]
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"`{param}` may hold at most {MAX_INPUTS} inputs; got {len(value)}", param=param)
    out = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise InvalidRequest(f"`{param}[{i}]` is empty", param=param)
            out.append(Input(item))
        elif isinstance(item, list) and item:
            out.append(Input(ids=check_token_ids(item, vocab_size, f"{param}[{i}]")))
        else:
            raise InvalidRequest(f"`{param}[{i}]` must be a non-empty string or list of token ids", param=param)
    return out


async def pool(
    served: ServedModel, inputs: list[Input], task: str, caller: Caller, dimensions: int | None = None
) -> list[Pooled]:
    """Every input's vector (a cross-encoder's: its one score), in order; 400s before any work."""
    deadline = asyncio.get_running_loop().time() + served.timeout_s
    served.check_prompt_size(max((len(x.text or "") + len(x.pair or "") for x in inputs), default=0), param="input")
    with tracing.span("tokenize"):
        encoded = await served.run_in_pool(
            _tokenize, served, inputs, size=sum(len(x.text or "") + len(x.pair or "") for x in inputs)
        )
    limit = served.max_model_len()
    for i, (ids, _) in enumerate(encoded):
        if limit is not None and len(ids) > limit:
            raise InvalidRequest(
                f"input {i} has {len(ids)} tokens, more than this model's limit of {limit}",
                param="input",
                code="context_length_exceeded",
            )
    rid = request_id(caller.request_id)
    priority = request_priority(caller, served.rules.scheduling_policy, None)
    news = [
        NewRequest(f"{rid}-{i}", ids, 1, pooling=PoolingParams(task, types, dimensions), priority=priority)
        for i, (ids, types) in enumerate(encoded)
    ]
    wave = served.admission.max_concurrent
    if served.rules.quotas is not None:
        await served.rules.quotas.enforce(
            caller, served.served_name, sum(len(ids) for ids, _ in encoded), min(len(news), wave)
        )
    outputs: list[RequestOutput] = []
    for start in range(0, len(news), wave):
        part = news[start : start + wave]
        slots = await admit(served, len(part), deadline, caller, priority)
        outputs += await unless_disconnected(caller, _wave(served, part, slots, deadline))
    return [Pooled(array("f", out.pooled or b""), out.num_prompt_tokens) for out in outputs]


def _tokenize(served: ServedModel, inputs: list[Input]) -> list[tuple[list[int], list[int]]]:
    """(token ids, token types) per input: a pair as the tokenizer joins two segments."""
    out = []
    for x in inputs:
        if x.text is None:
            out.append((x.ids, []))
        elif x.pair is None:
            out.append((served.tokenizer.encode(x.text, add_special_tokens=True), []))
        else:
            encoded = served.tokenizer(x.text, x.pair, add_special_tokens=True)
            out.append((encoded["input_ids"], encoded.get("token_type_ids") or []))
    return out


async def _wave(served: ServedModel, news: list[NewRequest], slots: list[Slot], deadline: float) -> list[RequestOutput]:
    """Every request's output; the first failure ends the others (they are aborted on their workers)."""
    tasks = [asyncio.ensure_future(_one(served, new, slot, deadline)) for new, slot in zip(news, slots)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _one(served: ServedModel, new: NewRequest, slot: Slot, deadline: float) -> RequestOutput:
    """One wire request to its end: its output, or the error that ended it (worker, timeout)."""
    trace = tracing.generation(new)
    clock = RequestClock(served.metrics, new.request_id, served.model_name)
    stream = None
    try:
        stream = served.client.submit(new, served.model_name, trace)
        async with asyncio.timeout_at(deadline):
            item = await stream.queue.get()
        trace.output(item)
        if isinstance(item, GenerationFailed):
            clock.outcome = "error"
            raise item
        clock.tokens(item)
        clock.outcome = "stop"
        return item
    except TimeoutError:
        clock.outcome = "timeout"
        raise RequestTimeout(f"the request took longer than --request-timeout ({served.timeout_s:g} s)") from None
    finally:
        slot.release()
        clock.done()
        trace.end(clock.outcome)
        if stream is not None and not stream.finished:
            served.client.abort(new.request_id)
