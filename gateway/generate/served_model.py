"""A served model (``ServedModel``): its tokenizer, template and workers, and one wire request's
stream as the core sees it: submit, then text deltas until the finish, aborting on exit.

The ``finally`` is the cancellation story: when a streaming client disconnects, Litestar cancels the
response, the cancellation reaches the ``await`` below, and the worker is told to stop the request
and free its KV blocks at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from common.protocol import FinishReason, NewRequest, RequestOutput, TokenLogprobs
from common.reasoning import ThinkTracker
from gateway.errors import ClientGone, GenerationFailed, InvalidRequest, NoWorkerAvailable, RequestTimeout
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.workers import RequestStream, Trace
from gateway.generate.lanes import SMALL_JOB_CHARS, Lanes, unless_disconnected
from gateway.generate.logprobs import TokenLogprob, TokenTexts
from gateway.generate.media import MediaRules
from gateway.generate.reasoning import Markers
from gateway.generate.stop import StopChecker
from gateway.generate.templates import Budget, ChatTemplate
from gateway.generate.tokenizer import IncrementalDetokenizer
from gateway.generate.vision import Vision
from gateway.ops import tracing
from gateway.ops.metrics import Metrics, RequestClock
from gateway.policy.admission import Admission, Slot
from gateway.policy.caller import Caller
from gateway.policy.rules import Rules

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CHARS_PER_TOKEN = 16  # generous: English averages about 4 characters a token


@dataclass(slots=True)
class TextDelta:
    """New text of one request, with the counts so far."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of this delta's tokens, when asked for
    prompt_logprobs: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)  # echo: every prompt token's
    stop_sequence: str | None = None  # the stop string that ended the text, when one did
    reasoning_tokens: int = 0  # of the completion tokens so far, those of a reasoning model's thinking
    token_ids: list[int] = field(default_factory=list)  # the tokens behind this delta (token-out endpoints)


@dataclass(slots=True)
class _Text:
    """One request's text so far: its detokenizer, stop strings and thinking count, and the
    characters sent and covered by the logprobs sent."""

    detokenizer: IncrementalDetokenizer
    stop: StopChecker
    thinking: ThinkTracker | None
    sent: int = 0
    covered: int = 0


class ServedModel:
    """Everything a route needs to run a prompt on one model: its tokenizer and template (used off
    the event loop), and the workers (of that model) behind the worker client."""

    vision: Vision | None = None  # an image-text model's processor (gateway/generate/vision.py); None: text only
    media: MediaRules = MediaRules()  # how its images are fetched (set by the registry from the flags)

    def __init__(
        self,
        client: WorkerClient,
        tokenizer: Any,
        template: ChatTemplate,
        model_name: str,
        lanes: Lanes,
        metrics: Metrics,
        admission: Admission,
        timeout_s: float,
        reasoning: Markers | None = None,
        rules: Rules | None = None,
    ) -> None:
        self.client = client
        self.vocab_size = len(tokenizer)
        self.metrics = metrics
        self.admission = admission
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self.template = template
        self.model_name = model_name
        self.served_name = model_name  # what answers echo as `model`: a LoRA adapter's name where one was asked for
        self.lanes = lanes
        self.reasoning = reasoning  # a reasoning model's thinking markers (gateway/generate/reasoning.py)
        self.rules = rules if rules is not None else Rules()  # the server's rules (gateway/policy/rules.py)

    def chat_prompt_ids(
        self,
        messages: list[dict[str, Any]],
        template_source: str | None = None,
        variables: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        budget: Budget | None = None,
    ) -> list[int]:
        """Render the chat template (the server's, or one the request brought, under ``budget``) with
        any extra ``variables`` (``chat_template_kwargs``, ``tools``) and tokenize; the template
        already holds the special tokens."""
        template = self.template if template_source is None else self.template.with_source(template_source)
        text = template.render(messages, add_generation_prompt, variables, budget)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt_ids(self, prompts: list[str | list[int]], add_special_tokens: bool = True) -> list[list[int]]:
        """Each prompt as token ids: a text tokenized, token ids (checked already) as they are."""
        return [
            self.tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str) else p
            for p in prompts
        ]

    def max_model_len(self) -> int | None:
        """The context length every registered worker of this model takes (None while none is registered)."""
        try:
            return self.client.limits(self.model_name)[0]
        except NoWorkerAvailable:
            return None

    def check_prompt_size(self, chars: int, count: int = 0, param: str = "messages") -> None:
        """Cheap bounds before any tokenizing: more characters than the context could hold at
        MAX_CHARS_PER_TOKEN each, or more messages than it has tokens, is a 400 at once (a 3 MiB
        message took 4.5 s to tokenize just to be refused). No bound while no worker says the length."""
        limit = self.max_model_len()
        if limit is None:
            return
        if count > limit:
            raise InvalidRequest(
                f"`{param}` holds {count} messages, more than this model's context length of {limit} tokens",
                param=param,
                code="context_length_exceeded",
            )
        if chars > limit * MAX_CHARS_PER_TOKEN:
            raise InvalidRequest(
                f"the prompt has {chars} characters, far more than this model's context length of {limit} tokens holds",
                param=param,
                code="context_length_exceeded",
            )

    async def run_in_pool(
        self,
        fn: Callable[..., Any],
        *args: Any,
        size: int = 0,
        budget: Budget | None = None,
        caller: Caller | None = None,
    ) -> Any:
        """Tokenizing and template rendering take milliseconds: keep them off the event loop. Inputs
        over SMALL_JOB_CHARS characters and requests' own templates (``budget``) go to their own
        lane; a budgeted render stops when its task is cancelled, or when ``caller`` hangs up."""
        lane = "big" if size > SMALL_JOB_CHARS or budget is not None else "small"
        job = (self.lanes.big if lane == "big" else self.lanes.small).submit(fn, *args)
        self.metrics.track_job(lane, job, lambda: budget.stopped if budget is not None else None)
        work = asyncio.wrap_future(job)
        try:
            return await (unless_disconnected(caller, work) if budget is not None else work)
        except (asyncio.CancelledError, ClientGone):
            if budget is not None:
                budget.cancelled.set()
            raise

    async def stream(
        self,
        request: NewRequest,
        slot: Slot,
        deadline: float,
        stops: list[str] | None = None,
        skip_special_tokens: bool = True,
        replay: list[RequestOutput] | None = None,
        on_output: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncIterator[TextDelta]:
        """Yield text deltas as the worker produces tokens; the last one carries the finish reason.

        ``slot`` (from ``admission.acquire()``) is released when the generation ends; past
        ``deadline`` (the event loop's clock) the request is aborted with a 504. ``replay``: outputs
        delivered before (by a gateway that died), passed through first, one by one as they came,
        so the text and its events come out the same; the worker then continues after their tokens.
        ``on_output`` sees every new output as it is processed.
        """
        try:
            async for delta in self._stream(
                request, deadline, stops or [], skip_special_tokens, replay or [], on_output
            ):
                yield delta
        finally:
            slot.release()

    async def _stream(
        self,
        request: NewRequest,
        deadline: float,
        stops: list[str],
        skip_special_tokens: bool,
        replay: list[RequestOutput],
        on_output: Callable[[RequestOutput], None] | None,
    ) -> AsyncIterator[TextDelta]:
        keep = (
            self.reasoning.special_ids if self.reasoning is not None and request.reasoning is not None else frozenset()
        )
        text = _Text(
            IncrementalDetokenizer(self.tokenizer, skip_special_tokens, self.token_texts.bytes, keep),
            StopChecker(stops),
            ThinkTracker(request.reasoning) if request.reasoning is not None else None,  # counts reasoning tokens
        )
        trace = tracing.generation(request)  # before the submit: it puts the trace context in the request
        pending = deque(replay)
        stream = None
        if not replay:
            try:
                stream = self.client.submit(request, self.model_name, trace)
            except BaseException:
                trace.end("error")
                raise
        clock = RequestClock(self.metrics, request.request_id, self.model_name)
        try:
            while True:
                if pending:
                    item = pending.popleft()
                    clock.tokens(item)
                else:
                    if stream is None:  # the replay is over: the worker goes on after its tokens
                        clock.outcome = "error"
                        stream = self.client.submit(
                            request, self.model_name, trace, [t for out in replay for t in out.new_token_ids]
                        )
                        clock.outcome = "cancelled"
                    item = await self._next(stream, deadline, clock, trace)
                    if on_output is not None and not isinstance(item, GenerationFailed):
                        on_output(item)
                if isinstance(item, GenerationFailed):
                    clock.outcome = "error"
                    raise item
                delta = self._delta(item, request, text, skip_special_tokens)
                if delta.finish_reason is not None:
                    clock.outcome = delta.finish_reason
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            clock.done()
            trace.end(clock.outcome)
            if stream is not None and not stream.finished:
                self.client.abort(request.request_id)

    def _delta(self, item: RequestOutput, request: NewRequest, text: _Text, skip_special_tokens: bool) -> TextDelta:
        """One output as a text delta: detokenized, cut at a stop string (whose text is never
        sent), its thinking counted, and its logprobs kept to the text sent."""
        chars = text.detokenizer.push(item.new_token_ids)
        for token in item.new_token_ids if text.thinking is not None else ():
            text.thinking.push(token)
        finish = item.finish_reason
        if finish is not None:
            chars += text.detokenizer.flush()
        chars, stopped = text.stop.push(chars)
        if stopped:  # the stop text is cut; the worker is told to stop in the finally
            finish = FinishReason.STOP
        elif finish is not None:
            chars += text.stop.flush()
        if finish == FinishReason.ABORT:
            finish = FinishReason.STOP
        logprobs = self._visible_logprobs(item, skip_special_tokens)
        if logprobs:  # entries past a stop string go with the cut text
            logprobs, text.covered = self._within(logprobs, text.covered, text.sent + len(chars) if stopped else None)
        text.sent += len(chars)
        delta = TextDelta(
            chars, finish, item.num_prompt_tokens, item.num_output_tokens, item.num_cached_tokens, logprobs
        )
        delta.stop_sequence = text.stop.matched if stopped else None
        delta.token_ids = text.stop.ids_before_stop(item.new_token_ids, self._length, stopped, text.sent)
        delta.reasoning_tokens = text.thinking.reasoning_tokens if text.thinking is not None else 0
        if item.prompt_logprobs is not None:
            ids = request.prompt_token_ids
            delta.prompt_logprobs = [(ids[0], None), *zip(ids[1:], item.prompt_logprobs)]
        return delta

    async def _next(
        self, stream: RequestStream, deadline: float, clock: RequestClock, trace: Trace
    ) -> RequestOutput | GenerationFailed:
        """The worker's next output (with any already waiting folded in), within the deadline."""
        try:
            async with asyncio.timeout_at(deadline):
                item = _merge_ready(await stream.queue.get(), stream.queue)
            trace.output(item)
        except TimeoutError:
            clock.outcome = "timeout"
            raise RequestTimeout(f"the request took longer than --request-timeout ({self.timeout_s:g} s)") from None
        if not isinstance(item, GenerationFailed):
            clock.tokens(item)
        return item

    def _length(self, token_id: int) -> int:
        return len(self.token_texts.text(token_id))

    def _within(self, logprobs: list[TokenLogprob], covered: int, limit: int | None) -> tuple[list[TokenLogprob], int]:
        """The entries whose tokens start before ``limit`` characters (all when None), and the
        characters covered after them."""
        kept = []
        for token_id, lp in logprobs:
            if limit is not None and covered >= limit:
                break
            kept.append((token_id, lp))
            covered += len(self.token_texts.text(token_id))
        return kept, covered

    def _visible_logprobs(self, item: RequestOutput, skip_special_tokens: bool) -> list[TokenLogprob]:
        """Logprobs of the tokens that make text: a skipped special token (the end-of-sequence one)
        has no place in ``content``, as in OpenAI's answers."""
        if not item.logprobs:
            return []
        pairs = zip(item.new_token_ids, item.logprobs)
        if not skip_special_tokens:
            return list(pairs)
        return [(t, lp) for t, lp in pairs if not self.token_texts.is_special(t)]


def _merge_ready(item: RequestOutput | GenerationFailed, queue: asyncio.Queue) -> RequestOutput | GenerationFailed:
    """Fold outputs that are already waiting into one: when the client or the gateway falls behind
    the worker, one chunk carries several tokens instead of the backlog growing chunk by chunk."""
    while isinstance(item, RequestOutput) and item.finish_reason is None and not queue.empty():
        following = queue.get_nowait()
        if isinstance(following, GenerationFailed):
            return following
        following.new_token_ids = item.new_token_ids + following.new_token_ids
        if item.logprobs and following.logprobs:
            following.logprobs = item.logprobs + following.logprobs
        if item.prompt_logprobs is not None:
            following.prompt_logprobs = item.prompt_logprobs
        item = following
    return item


def now_s() -> int:
    return int(time.time())
