"""A request as the worker tracks it: its tokens, how many are in the KV cache, and its blocks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING

from common.images import ImageInput
from common.protocol import FinishReason, Guide, NewRequest, SamplingParams, TokenLogprobs, WorkerEvent
from common.reasoning import ThinkTracker

if TYPE_CHECKING:
    from worker.kv_store.link import Lookup


class RequestStatus(IntEnum):
    """Ordered so that ``status > PREEMPTED`` means finished; one status, no booleans that disagree."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(frozen=True, slots=True)
class LoraRef:
    """The LoRA adapter a request runs with, as registered when it arrived (worker/lora)."""

    name: str
    path: str
    key: str  # unique per registration: keys the request's prefix-cache blocks and the adapter's resident weights


@dataclass(slots=True, eq=False)
class Request:
    """Scheduling state from two counters: ``num_computed_tokens`` (in the KV cache) and ``num_tokens``.

    Prefill, chunked prefill and decode are all "compute the tokens not yet computed"; a token is
    sampled once every known token is computed.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    sampling: SamplingParams
    stop_token_ids: frozenset[int]
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks so far
    error: str | None = None
    guide: Guide | None = None
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # of prompt tokens 1.., as computed
    prompt_logprobs_sent: bool = False
    output_start: int | None = None  # where generated tokens begin, when before num_prompt_tokens (resumed)
    outputs_sent: int = 0  # the next output's sequence number
    draft_token_ids: list[int] = field(
        default_factory=list
    )  # speculative tokens this step verifies after the last token
    events: list[WorkerEvent] | None = None  # trace events not yet sent; None when the request is not traced
    kv_store: Lookup | None = None  # its blocks' keys and what the KV store staged for it (worker/kv_store)
    reasoning: ThinkTracker | None = None  # a reasoning model's thinking: its budget, and where a guide starts
    lora: LoraRef | None = None  # its LoRA adapter (None: the base model), set by the engine
    priority: int = 0  # lower is more urgent: the scheduler's order and preemption follow it
    images: list[ImageInput] = field(default_factory=list)  # an image-text model's images (worker/models/vision.py)
    # encoder outputs by image index, from the step that reaches an image until its tokens are computed
    image_features: dict[int, object] = field(default_factory=dict)
    # Gemma 3: the prompt ranges of image tokens that attend to each other both ways (no chunk ends inside one)
    both_ways: list[tuple[int, int]] = field(default_factory=list)
    rope_positions: object = None  # M-RoPE models: the prompt's 3-D positions, [3, prompt tokens] (None: not computed)
    tenant: str | None = None  # the gateway's cache salt for its API key (None: shared with every key)
    retain_s: float = 0.0  # its prompt's cached blocks are kept ahead of others' this long (5m, 1h, 24h retention)

    def block_key(self, index: int, size: int) -> tuple:
        """What the prefix cache keys block ``index`` by: its tokens, and the pixel digest of every
        image whose tokens it holds (the placeholders are the same for every image)."""
        start = index * size
        key = tuple(self.token_ids[start : start + size])
        digests = tuple(self.images[k].digest for k in self.images_in(start, size))
        return key + digests if digests else key

    def images_in(self, start: int, count: int) -> list[int]:
        """The indices of the images whose tokens overlap prompt positions ``[start, start + count)``, in prompt order."""
        return [k for k, i in enumerate(self.images) if i.offset < start + count and start < i.offset + i.length]

    def images_to_encode(self, start: int, count: int) -> list[int]:
        """The images overlapping ``[start, start + count)`` whose encoder has not run yet: a step
        computing those positions encodes them."""
        return [k for k in self.images_in(start, count) if k not in self.image_features]

    def encodable(self, num_tokens: int, images: int) -> int:
        """How many of the next ``num_tokens`` to compute when the step may encode ``images`` more images:
        the chunk ends before the first image over that budget (vLLM's encoder budget); a later step encodes it."""
        pending = self.images_to_encode(self.num_computed_tokens, num_tokens)
        if len(pending) <= images:
            return num_tokens
        return max(self.images[pending[images]].offset - self.num_computed_tokens, 0)

    @property
    def cache_salt(self) -> str | None:
        """What seeds its prefix-cache hashes: blocks computed under one adapter serve only that adapter,
        and those of one API key only that key (the gateway's salt, unless it shares the cache)."""
        if self.tenant is None:
            return None if self.lora is None else self.lora.key
        return self.tenant if self.lora is None else f"{self.lora.key}\x00{self.tenant}"

    @classmethod
    def from_wire(cls, new: NewRequest, eos_token_ids: frozenset[int]) -> Request:
        stop = frozenset(new.stop_token_ids) | (frozenset() if new.ignore_eos else eos_token_ids)
        request = cls(
            request_id=new.request_id,
            token_ids=list(new.prompt_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            max_new_tokens=new.max_new_tokens,
            sampling=new.sampling,
            stop_token_ids=stop,
            guide=new.guide,
            output_start=len(new.prompt_token_ids) - min(new.resumed_tokens, len(new.prompt_token_ids)),
            events=[] if new.trace_context else None,
            reasoning=None if new.reasoning is None else ThinkTracker(new.reasoning),
            priority=new.priority,
            images=list(new.images),
            tenant=new.cache_salt,
            retain_s=new.retain_s,
        )
        if request.reasoning is not None:  # a resumed request: its thinking goes on where it was
            for token in request.generated_token_ids:
                request.reasoning.push(token)
        return request

    def record(self, name: str, **attributes: int | float | str | bool) -> None:
        """Note a trace event (sent with the next output); callers check ``events is not None``
        first, so an untraced request costs one comparison and builds no attributes."""
        if self.events is not None:
            self.events.append(WorkerEvent(name, time.time_ns(), attributes))

    def take_events(self) -> list[WorkerEvent]:
        """The events since the last output, handed over once."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    @property
    def generated_token_ids(self) -> list[int]:
        """Every token this generation produced, including those made before a resume."""
        return self.token_ids[self.num_prompt_tokens if self.output_start is None else self.output_start :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_new_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def append_token(self, token_id: int, max_model_len: int) -> None:
        """Add a sampled token and decide whether the request is done."""
        self.token_ids.append(token_id)
        if self.reasoning is not None:
            self.reasoning.push(token_id)
        if token_id in self.stop_token_ids:
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= self.max_new_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
