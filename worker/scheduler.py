"""Continuous batching: which requests run in the next step, and how many tokens each computes.

Every step has a token budget (``max_num_batched_tokens``). Running requests go first, one token
each when decoding, or the next chunk of a prompt that did not fit in earlier steps (chunked
prefill). Waiting requests are admitted in arrival order while the budget, the batch-size limit
and free KV blocks allow. While any request is decoding, prompt tokens in a step are further capped
at ``max_prefill_chunk``: on the CPU a step of 16 decodes takes 9-16 ms (the C++ step), and one
that also carries up to 64 prompt tokens 44-67 ms (each chunk token one more row of that step),
more with larger chunks, so a small cap keeps streaming requests' inter-token latency steady when a
long prompt arrives (TGI's ``max_batch_prefill_tokens`` and vLLM's chunked prefill play this role).
A chunk's attention also grows with the context before it (64 tokens over a 2,000-token prefix took
75 ms of attention alone), so past ``PREFILL_REFERENCE_CONTEXT`` tokens the cap shrinks in proportion.
Likewise an image-text model's step then encodes at most ``max_encoder_images`` images (each in the
step whose chunk first reaches it; a chunk ends before the first image over that budget).
When a running request needs a block and none is free, the most recently admitted request is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed from
prompt plus the tokens it already generated.

Priority (``Request.priority``, lower is more urgent; all 0 unless the gateway runs
``--scheduling-policy priority`` or batch work): both queues stay ordered by it, arrival order
within one priority, so the least urgent, most recently admitted request is the one preempted; and
a waiting request that does not fit (batch size or blocks) preempts less urgent running ones.
Batch work (``BATCH_PRIORITY``) also sits out every step that has interactive work to do: it keeps
its KV blocks and its place, but a step carrying it would be slower for the interactive rows beside
it (on a CPU each row costs; on any device a batch prompt chunk does), so it runs only in the
steps that interactive work leaves idle.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.protocol import BATCH_PRIORITY, TokenLogprobs
from worker.block_manager import BlockManager, blocks_for
from worker.request import Request, RequestStatus
from worker.speculative import Speculator

if TYPE_CHECKING:
    from worker.kv_store.link import KVStore

PREFILL_REFERENCE_CONTEXT = 512  # context up to which a prompt chunk may use the whole max_prefill_chunk
MIN_PREFILL_CHUNK = 8


@dataclass(slots=True)
class ScheduledBatch:
    """What the model runs this step: ``num_new_tokens[i]`` tokens of ``requests[i]``."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def subset(self, rows: range | list[int]) -> ScheduledBatch:
        return ScheduledBatch([self.requests[i] for i in rows], [self.num_new_tokens[i] for i in rows])

    def without(self, request_ids: set[str] | dict) -> ScheduledBatch:
        return self.subset([i for i, r in enumerate(self.requests) if r.request_id not in request_ids])

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(slots=True)
class RunOutput:
    """What the runner gives back for a batch: the new tokens of each request that produced any
    (one, or after drafts the accepted ones plus one), and the logprobs of those that asked."""

    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)

    def update(self, other: RunOutput) -> None:
        self.sampled.update(other.sampled)
        self.logprobs.update(other.logprobs)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.sampled.values()))


class Scheduler:
    """Owns the waiting queue and the running list; the engine calls schedule() then update()."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        max_prefill_chunk: int | None = None,
        speculator: Speculator | None = None,
        kv_store: KVStore | None = None,
        max_encoder_images: int = 0,
    ) -> None:
        self.blocks = blocks
        self.kv_store = kv_store  # a second tier under the prefix cache (worker/kv_store), when on
        self.speculator = speculator  # drafts for a lone decoding request, when speculation is on
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_chunk = max_prefill_chunk or max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_encoder_images = max_encoder_images  # images a step may encode (0: no limit); worker/models/vision.py
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.max_loras = 0  # most distinct LoRA adapters running at once (0: no adapters served); worker/lora
        self._budget = 0  # tokens left in the step being scheduled
        self._prefill_budget = 0  # prompt tokens left in it
        self._encoder_budget = 0  # images it may still encode
        self._yield = False  # interactive work waits or runs: batch work sits this step out

    def add(self, request: Request) -> None:
        self._enqueue(request, front=False)

    def _enqueue(self, request: Request, front: bool) -> None:
        """Into ``waiting`` by priority: behind its equals when new, ahead of them when preempted."""
        waiting, priority = self.waiting, request.priority
        if not front and (not waiting or waiting[-1].priority <= priority):
            waiting.append(request)
        elif front and (not waiting or waiting[0].priority >= priority):
            waiting.appendleft(request)
        else:
            after = (lambda other: other.priority >= priority) if front else (lambda other: other.priority > priority)
            waiting.insert(next((i for i, other in enumerate(waiting) if after(other)), len(waiting)), request)

    def _start(self, request: Request) -> None:
        """Into ``running`` by priority, behind its equals: its last is always the first to preempt."""
        running = self.running
        if not running or running[-1].priority <= request.priority:
            running.append(request)
        else:
            running.insert(next(i for i, other in enumerate(running) if other.priority > request.priority), request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch: running requests first, then newly admitted ones; a lone decoding
        request may get drafts to verify (worker/speculative.py)."""
        batch = ScheduledBatch()
        if self.kv_store is not None:
            self.kv_store.release_written()
        interactive = (r for queue in (self.running, self.waiting) for r in queue if r.priority < BATCH_PRIORITY)
        self._yield = next(interactive, None) is not None
        # Streams decoding in this step cap its prompt tokens and images; batch rows sitting it out do not.
        decoding = any(
            r.num_tokens - r.num_computed_tokens == 1
            for r in self.running
            if not (self._yield and r.priority >= BATCH_PRIORITY)
        )
        # A step of batch work alone stays as short as a step beside decoding streams: an
        # interactive request arriving meanwhile waits for it to end.
        batch_only = not self._yield and any(r.priority >= BATCH_PRIORITY for r in self.running)
        self._budget = self.max_num_batched_tokens
        capped = decoding or batch_only  # alone, a step encodes every image its chunk reaches, batched
        self._prefill_budget = self.max_prefill_chunk if capped else self.max_num_batched_tokens
        self._encoder_budget = (capped and self.max_encoder_images) or self.max_num_batched_tokens
        self._make_room()
        preempted = self._schedule_running(batch)
        if not preempted:
            self._schedule_waiting(batch)
        if self.speculator is not None and batch:
            self.speculator.draft(batch)
        return batch

    def _take(self, request: Request) -> int:
        """How many tokens ``request`` may compute this step, charged to the budgets."""
        remaining = request.num_tokens - request.num_computed_tokens
        num_tokens = min(remaining, self._budget)
        if remaining > 1:  # a prompt (chunk): also within the prefill budget
            num_tokens = min(num_tokens, self._prefill_budget)
            if self._prefill_budget < self.max_num_batched_tokens:  # others are decoding: mind the context too
                context = request.num_computed_tokens + num_tokens
                scaled = self.max_prefill_chunk * PREFILL_REFERENCE_CONTEXT // max(context, PREFILL_REFERENCE_CONTEXT)
                num_tokens = min(num_tokens, max(scaled, MIN_PREFILL_CHUNK))
            num_tokens = _whole_runs(request, num_tokens)
            num_tokens = request.encodable(num_tokens, self._encoder_budget)
        return num_tokens

    def _charge(self, request: Request, num_tokens: int) -> None:
        self._budget -= num_tokens
        if request.num_tokens - request.num_computed_tokens > 1:
            self._prefill_budget -= num_tokens
            self._encoder_budget -= len(request.images_to_encode(request.num_computed_tokens, num_tokens))

    def _make_room(self) -> None:
        """Waiting requests more urgent than running ones take their places when they do not fit
        beside them (before any is scheduled this step, so nothing preempted is in the batch)."""
        seats, reserved = self.max_num_seqs - len(self.running), 0
        for head in list(self.waiting):
            if not self.running or self.running[-1].priority <= head.priority:
                return  # the rest are less urgent still (the common case: everyone at 0)
            tokens = min(head.num_tokens - head.num_computed_tokens, self.max_prefill_chunk)
            needed = reserved + blocks_for(head.num_computed_tokens + tokens, self.blocks.block_size)
            while seats < 1 or self.blocks.num_free_blocks < needed - len(head.block_ids):
                if not self.running or self.running[-1].priority <= head.priority:
                    return
                self._preempt(self.running.pop())
                seats += 1
            seats, reserved = seats - 1, needed - len(head.block_ids)

    def _schedule_running(self, batch: ScheduledBatch) -> bool:
        """Give each running request its next tokens; preempt from the back when blocks run out."""
        preempted = False
        index = 0
        while index < len(self.running) and self._budget > 0:
            request = self.running[index]
            if self._yield and request.priority >= BATCH_PRIORITY:
                index += 1  # it keeps its blocks and its place, and waits for an idle step
                continue
            num_tokens = self._take(request)
            if num_tokens == 0:
                index += 1
                continue
            while not self.blocks.allocate(request, num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    return preempted
            self._add(batch, request, num_tokens)
            index += 1
        return preempted

    def _schedule_waiting(self, batch: ScheduledBatch) -> None:
        """Admit waiting requests in order while the budgets, batch size and free blocks allow."""
        while self.waiting and self._budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._yield and request.priority >= BATCH_PRIORITY:
                break  # the rest are batch work too (the queue is in priority order)
            if request.lora is not None and not self._lora_fits(request):
                break  # its adapter waits until one of the resident ones has no running request
            if self.kv_store is not None and not self.kv_store.ready(request, wait=not batch):
                break  # its blocks are still being read from the store; others run meanwhile
            cached = self.blocks.match_prefix(request)
            if self.kv_store is not None:
                cached += self.kv_store.load(request)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = cached
            num_tokens = self._take(request)
            if num_tokens == 0 or not self.blocks.allocate(request, num_tokens):
                self.blocks.free(request)  # don't pin shared blocks while waiting
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.events is not None:
                request.record(
                    "scheduled" if request.status == RequestStatus.WAITING else "resumed", cached_tokens=cached
                )
            request.status = RequestStatus.RUNNING
            self._start(request)
            self._add(batch, request, num_tokens)

    def _lora_fits(self, request: Request) -> bool:
        """Whether its adapter runs already, or one more adapter may (``max_loras``)."""
        running = {r.lora.key for r in self.running if r.lora is not None}
        return request.lora.key in running or len(running) < self.max_loras

    def _add(self, batch: ScheduledBatch, request: Request, num_tokens: int) -> None:
        computed = request.num_computed_tokens
        if request.events is not None and (computed < request.num_prompt_tokens or request.num_tokens - computed > 1):
            request.record("prefill_chunk", start=request.num_computed_tokens, tokens=num_tokens)
        batch.add(request, num_tokens)
        self._charge(request, num_tokens)

    def _preempt(self, request: Request) -> None:
        """Free everything and queue the request first in line, to recompute what it had."""
        if request.events is not None:
            request.record("preempted", computed_tokens=request.num_computed_tokens)
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self._enqueue(request, front=True)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance the counters after a step, append sampled tokens, and retire finished requests.

        A row that verified drafts computed its last token and the accepted drafts, which are
        the new tokens but the last: the rejected drafts' positions stay uncomputed (their cache
        slots are written over later). New tokens after one that ends the request are dropped.
        """
        finished = []
        for request, num_tokens in zip(batch.requests, batch.num_new_tokens):
            tokens = sampled.get(request.request_id, ())
            if request.draft_token_ids:
                num_tokens = len(tokens)
                request.draft_token_ids = []
                if tokens and self.speculator is not None:
                    self.speculator.verified(len(tokens))
            for token in tokens:
                request.append_token(token, self.max_model_len)
                if request.status.is_finished:
                    finished.append(request)
                    break
            # Computed: what ran, but never the newest token, which is only sampled (nor what an end cut off).
            request.num_computed_tokens = min(
                request.num_computed_tokens + num_tokens, request.num_tokens - (1 if tokens else 0)
            )
            self.blocks.register_full_blocks(request)
            if self.kv_store is not None:
                self.kv_store.write_behind(request)
        for request in finished:
            self._retire(request)
        return finished

    def finish(self, request_ids: set[str], status: RequestStatus) -> list[Request]:
        """End these requests now (abort, error), wherever they are; return the ones found."""
        found = [r for r in (*self.waiting, *self.running) if r.request_id in request_ids]
        for request in found:
            request.status = status
            self._retire(request)
        return found

    def _retire(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        if self.kv_store is not None:
            self.kv_store.cancel(request)
        self.blocks.free(request)


def _whole_runs(request: Request, num_tokens: int) -> int:
    """A chunk that would end inside a run of tokens attending both ways (Gemma 3's images) ends before
    it, or, starting inside or at it, after it: the run's tokens are computed together, as generate does."""
    start = request.num_computed_tokens
    end = start + num_tokens
    if num_tokens <= 0:
        return num_tokens
    for low, high in request.both_ways:
        if low < end < high:
            return low - start if low > start else high - start
    return num_tokens
