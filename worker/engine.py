"""The engine: requests in, one step at a time, token deltas out. No sockets here (see worker.proc)."""

from __future__ import annotations

import logging
import time
from collections import deque

from common.grammar import GrammarError
from common.model_source import ModelSource
from common.protocol import FinishReason, Heartbeat, NewRequest, RequestOutput, StepOutputs, TokenLogprobs
from worker.block_manager import BlockManager, blocks_for
from worker.config import WorkerConfig
from worker.model_runner import ModelRunner
from worker.request import Request, RequestStatus
from worker.scheduler import Scheduler

log = logging.getLogger(__name__)


class Engine:
    """Continuous batching over a paged KV cache: ``add_request``/``abort`` between steps, ``step`` to run."""

    def __init__(self, source: ModelSource, config: WorkerConfig) -> None:
        self.runner = ModelRunner(source, config)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.prefix_caching)
        self.max_model_len = self.runner.max_model_len
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len, config.max_prefill_chunk
        )
        self.max_num_seqs = config.max_num_seqs
        self._rejected: list[RequestOutput] = []
        self._requests: dict[str, Request] = {}
        self.num_steps = 0
        self.peak_batch_size = 0
        self._recent_tokens: deque[tuple[float, int]] = deque()

    def add_request(self, new: NewRequest) -> None:
        """Queue a request; one that can never fit is answered with an error at the next step."""
        request = Request.from_wire(new, self.runner.eos_token_ids)
        error = self._check(request)
        if error is not None:
            self._rejected.append(RequestOutput(new.request_id, [], FinishReason.ERROR, request.num_prompt_tokens, error=error))
            return
        try:
            self.runner.add_request(request)
        except GrammarError as exc:
            self._rejected.append(RequestOutput(new.request_id, [], FinishReason.ERROR, request.num_prompt_tokens, error=str(exc), bad_request=True))
            return
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        log.info("request %s queued: %d prompt tokens, up to %d new", request.request_id, request.num_prompt_tokens,
                 request.max_new_tokens, extra={"request_id": request.request_id})

    def _check(self, request: Request) -> str | None:
        if request.request_id in self._requests:
            return f"request id {request.request_id} is already running"
        if request.num_prompt_tokens == 0:
            return "the prompt is empty"
        if request.max_new_tokens < 1:
            return "max_new_tokens must be at least 1"
        if any(not 0 <= t < self.runner.vocab_size for t in request.sampling.logit_bias):
            return f"logit_bias names a token outside the vocabulary (0 to {self.runner.vocab_size - 1})"
        total = request.max_total_tokens
        if total > self.max_model_len:
            return f"prompt ({request.num_prompt_tokens}) + max tokens ({request.max_new_tokens}) exceeds the context length ({self.max_model_len})"
        if blocks_for(total, self.blocks.block_size) > self.blocks.num_blocks:
            return f"prompt + max tokens ({total}) exceeds this worker's KV cache ({self.blocks.capacity_tokens} tokens)"
        return None

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        aborted = self.scheduler.finish(set(request_ids), RequestStatus.FINISHED_ABORTED)
        return [self._finish_output(r, []) for r in aborted]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an error inside a step: end every request with the error and leave the cache empty."""
        failed = self.scheduler.finish(set(self._requests), RequestStatus.FINISHED_ERROR)
        for request in failed:
            request.error = message
        return [self._finish_output(r, []) for r in failed]

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._rejected)

    def step(self) -> StepOutputs:
        """Schedule a batch, run the model once over it, and report what each request gained."""
        outputs, self._rejected = self._rejected, []
        batch = self.scheduler.schedule()
        if not batch:
            return StepOutputs(outputs)
        sampled, logprobs = self.runner.execute(batch)
        finished = set(self.scheduler.update(batch, sampled))
        for request in batch.requests:
            token = sampled.get(request.request_id)
            lp = logprobs.get(request.request_id)
            if request in finished:
                outputs.append(self._finish_output(request, [token], lp))
            elif token is not None:
                outputs.append(self._output(request, [token], lp))
        self._count_step(len(batch), len(sampled))
        return StepOutputs(outputs, batch_size=len(batch), num_tokens=batch.total_tokens)

    def _output(self, request: Request, new_token_ids: list[int], logprobs: TokenLogprobs | None = None) -> RequestOutput:
        prompt = None
        if new_token_ids and request.sampling.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt, request.prompt_logprobs_sent = request.prompt_logprobs, True  # complete once a token is sampled
        return RequestOutput(
            request.request_id,
            new_token_ids,
            request.finish_reason,
            request.num_prompt_tokens,
            request.num_output_tokens,
            request.num_cached_tokens,
            error=request.error,
            logprobs=None if logprobs is None else [logprobs],
            prompt_logprobs=prompt,
        )

    def _finish_output(self, request: Request, new_token_ids: list[int], logprobs: TokenLogprobs | None = None) -> RequestOutput:
        log.info("request %s %s: %d generated, %d prompt tokens from the prefix cache", request.request_id,
                 request.finish_reason, request.num_output_tokens, request.num_cached_tokens,
                 extra={"request_id": request.request_id, "finish_reason": request.finish_reason})
        del self._requests[request.request_id]
        self.runner.remove_request(request)
        return self._output(request, new_token_ids, logprobs)

    def _count_step(self, batch_size: int, num_sampled: int) -> None:
        self.num_steps += 1
        self.peak_batch_size = max(self.peak_batch_size, batch_size)
        now = time.monotonic()
        self._recent_tokens.append((now, num_sampled))
        while self._recent_tokens and self._recent_tokens[0][0] < now - 10.0:
            self._recent_tokens.popleft()

    def load(self) -> Heartbeat:
        """Load figures for the gateway: queue lengths, free KV blocks, recent tokens/s."""
        now = time.monotonic()
        recent = sum(n for t, n in self._recent_tokens if t >= now - 10.0)
        return Heartbeat(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_blocks=self.blocks.num_free_blocks,
            total_blocks=self.blocks.num_blocks,
            tokens_per_s=recent / 10.0,
            steps=self.num_steps,
            peak_batch_size=self.peak_batch_size,
            preemptions=self.scheduler.num_preemptions,
            prefix_hit_tokens=self.blocks.hit_tokens,
            prefix_queried_tokens=self.blocks.queried_tokens,
        )
