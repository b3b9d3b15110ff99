"""The one generation core every API dialect speaks through.

A dialect (OpenAI chat, OpenAI completions, OpenAI responses, Anthropic messages: one module each
under ``gateway/routes``) translates its body into a ``GenerationRequest``, calls ``start`` (which
checks the limits and takes the admission slots, so a 429 or a 400 comes before any response
starts), and translates the ``Generation``'s events back: streamed as they come (``events``), or
folded into one ``Choice`` per generation (``collect``). Stop strings, tool-call parsing, grammars,
logprobs, the detokenizer, admission and errors all live below this line, written once.

Events of one choice come in this order: ``PromptLogprobs`` (echo only), then ``Text`` and
``ToolCallDelta`` as the text grows, then one ``Finish``. Choices (``n``, several prompts)
interleave, each event naming its choice by ``index``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import Request

from common.protocol import Guide, NewRequest, RequestOutput, TokenLogprobs
from gateway import tracing
from gateway.admission import Slot
from gateway.auth import caller_owner
from gateway.errors import ClientGone, GatewayError, RequestTimeout
from gateway.generation import Generator, TextDelta
from gateway.logprobs import TokenLogprob
from gateway.schemas import SamplingOptions
from gateway.templates import Budget
from gateway.tools import (
    CallDelta,
    ToolCall,
    ToolPlan,
    prepare_messages,
    template_variables,
    tool_plan,
)
from gateway.validation import checked_guide, new_request

# Why a choice ended, in the core's words (each dialect names them its own way):
END = "stop"  # the model ended it (end-of-sequence, a stop token)
STOP_SEQUENCE = "stop_sequence"  # a stop string ended it (``Finish.stop_sequence`` says which)
LENGTH = "length"  # the token budget (max_tokens) or the context ran out
TOOL_CALLS = "tool_calls"  # it ended having called tools


@dataclass(slots=True, kw_only=True)
class GenerationRequest:
    """One request in the gateway's own terms: the prompts as token ids and how to continue them."""

    prompts: list[list[int]]
    sampling: SamplingOptions
    max_tokens: int | None  # None: all the room left in the context
    request_id: str
    max_tokens_param: str = "max_tokens"  # the field a budget error names
    stops: list[str] = field(default_factory=list)
    guide: Guide | None = None  # a grammar for the output (response formats); tools bring their own
    tools: ToolPlan | None = None
    n: int = 1  # generations per prompt
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    prompt_logprobs: int | None = None
    n_param: str = "n"  # the field ``n`` came from (``best_of`` in legacy completions), for errors
    # A response taken over from a gateway that died (n = 1): the worker outputs it had delivered,
    # replayed through the same pipeline before the rest is generated; and each new output as it
    # comes (so it can be logged for the next takeover).
    replay: list[RequestOutput] = field(default_factory=list)
    on_output: Callable[[RequestOutput], None] | None = None
    # Usage metering (gateway.state.usage): set from the request by ``start`` unless given here.
    owner: str | None = None
    meter: Any = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Text:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens behind this text, when asked for


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    call: CallDelta


@dataclass(slots=True)
class PromptLogprobs:
    index: int
    logprobs: list[tuple[int, TokenLogprobs | None]]  # every prompt token's (the first has none)


@dataclass(slots=True)
class Finish:
    index: int
    reason: str  # END, STOP_SEQUENCE, LENGTH or TOOL_CALLS
    usage: Usage
    stop_sequence: str | None = None


Event = Text | ToolCallDelta | PromptLogprobs | Finish


@dataclass(slots=True)
class Choice:
    """One generation, whole."""

    index: int
    text: str = ""  # what is not tool calls
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    finish: Finish | None = None

    @property
    def content(self) -> str | None:
        """The text as a message's content: None when there is only a tool call."""
        if not self.tool_calls:
            return self.text
        return self.text.strip() or None


def total_usage(finishes: list[Finish], n: int = 1) -> Usage:
    """Usage of all choices; each prompt counts once however many choices (``n``) it had."""
    prompts = [f.usage for f in finishes[::n]]
    return Usage(sum(u.prompt_tokens for u in prompts), sum(f.usage.completion_tokens for f in finishes), sum(u.cached_tokens for u in prompts))


def message_chars(messages: list[dict]) -> int:
    """The characters a conversation brings (contents and earlier calls' arguments), for the cheap bounds."""
    chars = 0
    for message in messages:
        content = message.get("content")
        chars += len(content) if isinstance(content, str) else 0
        for call in message.get("tool_calls") or ():
            arguments = call.get("function", {}).get("arguments") if isinstance(call, dict) else None
            chars += len(arguments) if isinstance(arguments, str) else 0
    return chars


async def chat_prompt(
    generator: Generator,
    messages: list[dict],
    tools: ToolPlan,
    template_source: str | None = None,
    template_kwargs: dict | None = None,
    request: Request | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """A conversation (messages as chat templates read them) rendered with its tools and tokenized.
    Too many characters or messages are refused before any work; a request's own template renders
    under a budget, and stops when ``request``'s client hangs up."""
    chars = message_chars(messages)
    generator.check_prompt_size(chars, len(messages))
    source = template_source or generator.template.source
    messages = prepare_messages(messages, tools, source)
    variables = {**(template_kwargs or {}), **template_variables(tools, source)}
    budget = Budget() if template_source is not None else None
    work = generator.run_in_pool(
        generator.chat_prompt_ids, messages, template_source, variables, add_generation_prompt, budget, size=chars, budget=budget
    )
    with tracing.span("template+tokenize"):
        if budget is not None and request is not None:
            return await unless_disconnected(request, work)
        return await work


NO_TOOLS = tool_plan(None, None, None)


async def start(generator: Generator, req: GenerationRequest, request: Request | None = None) -> Generation:
    """Check the request against the workers' limits and admit it: errors (400, 429, 503, 504) come
    now, before a response starts. One wire request per choice, ``n`` per prompt, admitted all
    together or not at all. The admission wait counts toward ``--request-timeout`` and ends when
    ``request``'s client hangs up."""
    deadline = asyncio.get_running_loop().time() + generator.timeout_s
    limits = generator.client.limits(generator.model_name)
    tools = req.tools or NO_TOOLS
    guide = checked_guide(tools.guide(), "tools") or req.guide
    if tools.mode in ("auto", "none"):
        for i, parameters in enumerate(tools.parameter_guides()):
            checked_guide(parameters, f"tools[{i}]")
    count = len(req.prompts) * req.n
    what = f"{len(req.prompts)} prompts × `{req.n_param}` {req.n}" if len(req.prompts) > 1 else f"`{req.n_param}` {req.n}"
    generator.admission.check_fits(count, req.n_param if req.n > 1 else "prompt", what)
    news = []
    for p, ids in enumerate(req.prompts):
        rid = f"{req.request_id}-p{p}" if len(req.prompts) > 1 else req.request_id
        for choice in range(req.n):
            news.append(
                new_request(req.sampling, ids, req.max_tokens, req.max_tokens_param, limits, rid, generator.vocab_size, choice, guide, req.logprobs)
            )
            news[-1].sampling.prompt_logprobs = req.prompt_logprobs
    if request is not None and req.meter is None:
        req.meter = getattr(request.app.state, "usage", None)
        req.owner = caller_owner(request)
    tracing.describe_request(generator.model_name, req)
    with tracing.span("queue"):
        slots = await _admit(generator, count, deadline, request)
    return Generation(generator, req, tools, news, slots, deadline)


async def _admit(generator: Generator, count: int, deadline: float, request: Request | None) -> list[Slot]:
    async def wait() -> list[Slot]:
        try:
            async with asyncio.timeout_at(deadline):
                return await generator.admission.acquire(count)
        except TimeoutError:
            raise RequestTimeout(f"the request waited longer than --request-timeout ({generator.timeout_s:g} s) for the server to take it") from None

    if request is None:
        return await wait()
    return await unless_disconnected(request, wait())


class Generation:
    """An admitted request: its events as they come, or its choices once all are done."""

    def __init__(
        self, generator: Generator, req: GenerationRequest, tools: ToolPlan, news: list[NewRequest], slots: list[Slot], deadline: float
    ) -> None:
        self.generator = generator
        self.deadline = deadline  # the event loop's clock: --request-timeout from the request's start
        self.req = req
        self.tools = tools
        self.news = news
        self.slots = slots
        self.request_id = news[0].request_id
        self.first_usage: Usage | None = None  # prompt and cached tokens, from the first output of choice 0

    @property
    def choices(self) -> int:
        return len(self.news)

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's events, in arrival order."""
        parsers = [self.tools.parser() for _ in self.news]
        async for index, delta in self._merged():
            if delta.prompt_logprobs:
                yield PromptLogprobs(index, delta.prompt_logprobs)
            if self.first_usage is None and index == 0:
                self.first_usage = Usage(delta.prompt_tokens, 0, delta.cached_tokens)
            parser = parsers[index]
            text, calls = (delta.text, []) if parser is None else parser.push(delta.text)
            if delta.finish_reason is not None and parser is not None:
                rest, more = parser.finish()
                text, calls = text + rest, calls + more
            if text or delta.logprobs:
                yield Text(index, text, delta.logprobs)
            for call in calls:
                yield ToolCallDelta(index, call)
            if delta.finish_reason is not None:
                usage = Usage(delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens)
                self._meter(index, usage)
                yield Finish(index, _reason(delta, parser is not None and bool(parser.calls)), usage, delta.stop_sequence)

    def _meter(self, index: int, usage: Usage) -> None:
        """Bill a finished choice to its key: its output, and its prompt once per prompt (``n`` share one)."""
        if self.req.meter is None:
            return
        first = index % self.req.n == 0
        prompt, cached = (usage.prompt_tokens, usage.cached_tokens) if first else (0, 0)
        self.req.meter.record(self.req.owner or "", self.generator.model_name, prompt, cached, usage.completion_tokens, requests=int(index == 0))

    async def collect(self, request: Request) -> list[Choice]:
        """All choices whole; the generation is aborted if the client hangs up first."""
        return await unless_disconnected(request, self._collect())

    async def _collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(self.choices)]
        async for event in self.events():
            choice = choices[event.index]
            if isinstance(event, Text):
                choice.text += event.text
                choice.logprobs.extend(event.logprobs)
            elif isinstance(event, ToolCallDelta):
                call = event.call
                if call.id is not None:
                    choice.tool_calls.append(ToolCall(call.name or "", call.arguments, call.id))
                else:
                    choice.tool_calls[call.index].arguments += call.arguments
            elif isinstance(event, PromptLogprobs):
                choice.prompt_logprobs.extend(event.logprobs)
            else:
                choice.finish = event
        return choices

    async def _merged(self) -> AsyncIterator[tuple[int, TextDelta]]:
        """The deltas of every choice as (choice index, delta), in arrival order."""
        generator, stops, skip = self.generator, self.req.stops, self.req.sampling.skip_special_tokens
        if len(self.news) == 1:
            async for delta in generator.stream(self.news[0], self.slots[0], self.deadline, stops, skip, self.req.replay, self.req.on_output):
                yield 0, delta
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for delta in generator.stream(self.news[index], self.slots[index], self.deadline, stops, skip):
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


def _reason(delta: TextDelta, called: bool) -> str:
    if delta.stop_sequence is not None:
        return STOP_SEQUENCE
    if called and delta.finish_reason == END:
        return TOOL_CALLS
    return LENGTH if delta.finish_reason == LENGTH else END


async def unless_disconnected(request: Request, work):
    """Run ``work`` (a non-streamed generation) but cancel it, which aborts it on the worker, as
    soon as the client hangs up; streams get this from Litestar, plain responses need it here."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            gone = True
            task.cancel()  # only a request: wait until it took effect, and retrieve its outcome
            await asyncio.gather(task, return_exceptions=True)
    if gone:
        raise ClientGone("the client closed the connection; the request was aborted")
    return task.result()
