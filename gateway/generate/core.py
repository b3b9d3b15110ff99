"""The one generation core every API dialect speaks through.

A dialect (OpenAI chat, OpenAI completions, OpenAI responses, Anthropic messages: one module each under
``gateway/http/routes``) translates its body into one ``CoreRequest``, checking nothing but its own shapes, and
calls ``start``: every check (gateway/generate/validation.py's ``prepare``: limits, tools, grammars, token ids, templates),
the tokenizing and the admission happen there, so a 400 or a 429 comes before any response starts. It then
translates the ``Generation``'s events back: streamed as they come (``events``), or folded into one ``Choice`` per
generation (``collect``). Stop strings, tool-call parsing, grammars, logprobs, the detokenizer, admission and errors
all live below this line, written once. Events of one choice come in this order: ``PromptLogprobs`` (echo only),
then a reasoning model's ``Thinking``, then ``Text`` and ``ToolCallDelta`` as the text grows, then one ``Finish``.
Choices (``n``, several prompts) interleave, each naming its ``index``.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

from common.pooling import PoolingTask
from gateway.errors import GatewayError, RequestTimeout
from gateway.generate.abilities import require
from gateway.generate.events import (
    END,
    LENGTH,
    STOP_SEQUENCE,
    TOOL_CALLS,
    Choice,
    Event,
    Finish,
    PromptLogprobs,
    Text,
    Thinking,
    ToolCallDelta,
    Usage,
)
from gateway.generate.lanes import unless_disconnected
from gateway.generate.reasoning import ReasoningParser
from gateway.generate.request import CoreRequest, request_id
from gateway.generate.served_model import ServedModel, TextDelta
from gateway.generate.tools import ToolCall, ToolOutputParser
from gateway.generate.validation import Prepared, check, prepare
from gateway.ops import tracing
from gateway.policy.admission import Slot
from gateway.policy.caller import Caller
from gateway.policy.priority import request_priority

RETENTION_S = {"24h": 86400.0}  # OpenAI's prompt_cache_retention; "in_memory" is the plain LRU


async def start(served: ServedModel, req: CoreRequest, caller: Caller | None = None) -> Generation:
    """Check the request, tokenize its prompt and admit it: errors (400, 429, 503, 504) come now,
    before a response starts. One wire request per choice, ``n`` per prompt, admitted all together
    or not at all. The admission wait counts toward ``--request-timeout`` and ends when ``caller``
    hangs up. No caller: the gateway's own request (a response taken over), billed to nobody."""
    deadline = asyncio.get_running_loop().time() + served.timeout_s
    require(served, PoolingTask.GENERATE)  # an embedding model's is a 400 that says what it serves
    rules = served.rules
    if req.request_id is None:
        req.request_id = request_id(caller.request_id if caller is not None else None)
    if caller is not None and req.meter is None:
        req.meter = rules.usage
        req.owner = caller.owner
    req.priority = request_priority(
        caller, rules.scheduling_policy, req.sampling.priority, getattr(req.sampling, "service_tier", None)
    )
    salt, affinity = cache_keys(caller, rules.share_prefix_cache, req.sampling)
    if req.cache_salt is not None:  # the request's own salt (vLLM's ``cache_salt``), within its key's
        salt = f"{salt or ''}/{req.cache_salt}"
    req.cache_salt, req.affinity_key = salt, req.affinity_key or affinity
    req.retain_s = req.retain_s or RETENTION_S.get(getattr(req.sampling, "prompt_cache_retention", None), 0.0)
    prepared = await prepare(served, req, caller)
    for new in prepared.news:
        new.retain_s = req.retain_s  # its prompt's cached blocks are evicted after every unretained one
    if rules.quotas is not None:
        await rules.quotas.enforce(caller, served.served_name, sum(map(len, prepared.prompts)), len(prepared.news))
    tracing.describe_request(lambda: req.span_attributes(served.model_name, prepared.prompts))
    with tracing.span("queue"):
        slots = await admit(served, len(prepared.news), deadline, caller, req.priority)
    return Generation(served, req, prepared, slots, deadline)


def cache_keys(caller: Caller | None, shared: bool, sampling: object) -> tuple[str | None, str | None]:
    """(prefix-cache salt, routing affinity key): each API key's cached blocks serve only that key
    (vLLM's ``cache_salt``: one tenant cannot time another's prompts) unless ``--share-prefix-cache``;
    ``prompt_cache_key`` (else the ``x-session-id`` header) keeps a conversation on one worker."""
    owner = caller.owner if caller is not None else ""
    salt = None if shared or not owner else hashlib.blake2b(owner.encode(), digest_size=12).hexdigest()
    affinity = getattr(sampling, "prompt_cache_key", None) or (caller.session_id if caller is not None else None)
    return salt, affinity


async def prompt_ids(served: ServedModel, req: CoreRequest, caller: Caller | None = None) -> list[list[int]]:
    """The prompts as token ids, after the same checks as ``start`` (for counting tokens)."""
    return (await prepare(served, req, caller, admit=False)).prompts


async def chat_text(served: ServedModel, req: CoreRequest) -> str | None:
    """A chat request's prompt as the server's template renders it, after the same checks, not
    tokenized (None: not a chat): ``prompt_ids`` without the tokenizing, most of its cost."""
    checked = check(served, req, None)
    if checked.messages is None:
        return None
    args = (checked.messages, req.add_generation_prompt, checked.variables)
    return await served.run_in_pool(served.template.render, *args, size=checked.chars)


async def admit(
    served: ServedModel, count: int, deadline: float, caller: Caller | None, priority: int = 0
) -> list[Slot]:
    async def wait() -> list[Slot]:
        try:
            async with asyncio.timeout_at(deadline):
                return await served.admission.acquire(count, caller.owner if caller is not None else "", priority)
        except TimeoutError:
            raise RequestTimeout(
                f"the request waited longer than --request-timeout ({served.timeout_s:g} s) for the server to take it"
            ) from None

    return await unless_disconnected(caller, wait())


class Generation:
    """An admitted request: its events as they come, or its choices once all are done."""

    def __init__(
        self, served: ServedModel, req: CoreRequest, prepared: Prepared, slots: list[Slot], deadline: float
    ) -> None:
        self.served = served
        self.deadline = deadline  # the event loop's clock: --request-timeout from the request's start
        self.req = req
        self.prompts = prepared.prompts  # token ids, one list per prompt
        self.tools = prepared.tools
        self.parsers = prepared.parsers
        self.thinkers = prepared.thinkers
        self.stops = prepared.stops
        self.news = prepared.news
        self.slots = slots
        self.request_id = self.news[0].request_id
        self.first_usage: Usage | None = None  # prompt and cached tokens, from the first output of choice 0

    @property
    def choices(self) -> int:
        return len(self.news)

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events, in arrival order."""
        async for index, delta in self._merged():
            if delta.prompt_logprobs:
                yield PromptLogprobs(index, delta.prompt_logprobs)
            if self.first_usage is None and index == 0:
                self.first_usage = Usage(delta.prompt_tokens, 0, delta.cached_tokens)
            thinker = self.thinkers[index] if self.thinkers else None
            found = parsed(index, delta, self.parsers[index], thinker)
            if delta.finish_reason is not None:
                self._meter(index, _usage(delta))
            for event in found:
                yield event

    async def outputs(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """Every choice's deltas as the worker made them, unparsed (token ids in, token ids out), each
        choice billed at its finish as ``events`` bills it."""
        async for index, delta in self._merged():
            if delta.finish_reason is not None:
                self._meter(index, _usage(delta))
            yield index, delta

    def _meter(self, index: int, usage: Usage) -> None:
        """Bill a finished choice to its key: its output, and its prompt once per prompt (``n`` share one)."""
        if self.req.meter is None:
            return
        first = index % self.req.n == 0
        prompt, cached = (usage.prompt_tokens, usage.cached_tokens) if first else (0, 0)
        self.req.meter.record(
            self.req.owner or "",
            self.served.model_name,
            prompt,
            cached,
            usage.completion_tokens,
            requests=int(index == 0),
        )

    async def collect(self, caller: Caller | None) -> list[Choice]:
        """All choices whole; the generation is aborted if the caller hangs up first."""
        return await unless_disconnected(caller, self._collect())

    async def _collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(self.choices)]
        async for event in self.events():
            gather(choices[event.index], event)
        return choices

    async def _merged(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """The deltas of every choice as (choice index, delta), in arrival order."""
        served, stops, skip = self.served, self.stops, self.req.sampling.skip_special_tokens
        if len(self.news) == 1:
            async for delta in served.stream(
                self.news[0], self.slots[0], self.deadline, stops, skip, self.req.replay, self.req.on_output
            ):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in served.stream(self.news[index], self.slots[index], self.deadline, stops, skip):
                    queue.put_nowait((index, delta))
            except GatewayError as exc:
                queue.put_nowait((index, exc))
            finally:
                queue.put_nowait((index, None))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.news))]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, GatewayError):
                    raise item
                else:
                    yield index, item
        finally:  # the client left or one choice failed: stop the others (which aborts them on the worker)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def parsed(
    index: int, delta: TextDelta, parser: ToolOutputParser | None, thinker: ReasoningParser | None
) -> list[Event]:
    """One choice's delta as events: a reasoning model's thinking first, then the answer's text and
    the tool calls read from it, and at the end its ``Finish`` (also derender's reading of a text)."""
    found: list[Event] = []
    text = delta.text
    if thinker is not None:  # the thinking first: the tool calls and the answer come after it
        thinking, text = thinker.push(text)
        if delta.finish_reason is not None:
            more, rest = thinker.finish()
            thinking, text = thinking + more, text + rest
        if thinking:
            found.append(Thinking(index, thinking))
    text, calls = (text, []) if parser is None else parser.push(text)
    if delta.finish_reason is not None and parser is not None:
        rest, more_calls = parser.finish(cut=delta.finish_reason == LENGTH)
        text, calls = text + rest, calls + more_calls
    if text or delta.logprobs:
        found.append(Text(index, text, delta.logprobs))
    found += [ToolCallDelta(index, call) for call in calls]
    if delta.finish_reason is not None:
        called = parser is not None and bool(parser.calls)
        found.append(Finish(index, _reason(delta, called), _usage(delta), delta.stop_sequence))
    return found


def gather(choice: Choice, event: Event) -> None:
    """Add an event to its choice, as a whole answer holds it."""
    if isinstance(event, Text):
        choice.text += event.text
        choice.logprobs.extend(event.logprobs)
    elif isinstance(event, ToolCallDelta):
        call = event.call
        if call.id is not None:
            choice.tool_calls.append(ToolCall(call.name or "", call.arguments, call.id))
        else:
            choice.tool_calls[call.index].arguments += call.arguments
    elif isinstance(event, Thinking):
        choice.reasoning += event.text
    elif isinstance(event, PromptLogprobs):
        choice.prompt_logprobs.extend(event.logprobs)
    else:
        choice.finish = event


def _usage(delta: TextDelta) -> Usage:
    return Usage(delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens, delta.reasoning_tokens)


def _reason(delta: TextDelta, called: bool) -> str:
    if delta.stop_sequence is not None:
        return STOP_SEQUENCE
    if called and delta.finish_reason == END:
        return TOOL_CALLS
    return LENGTH if delta.finish_reason == LENGTH else END
