"""The engine: requests in, one step at a time, token deltas out. No sockets (worker/proc.py has them)
and no tensors (its runner has them: worker/runner, or a fake one in tests)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from common.grammar import GrammarError
from common.protocol import FinishReason, Heartbeat, NewRequest, RequestOutput, StepOutputs, TokenLogprobs, WorkerEvent
from worker.block_manager import BlockManager, blocks_for
from worker.config import WorkerConfig
from worker.isolation import run_isolating
from worker.kv_store.link import KVStore
from worker.lora.registry import LoraRegistry, lora_load
from worker.pooling import PoolingQueue, ended
from worker.request import Request, RequestStatus
from worker.scheduler import RunOutput, ScheduledBatch, Scheduler
from worker.speculative import Speculator

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine needs of a model runner (worker/runner; tests use one without a model)."""

    num_blocks: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    device_type: str

    def add_request(self, request: Request) -> None: ...
    def remove_request(self, request: Request) -> None: ...
    def execute(self, batch: ScheduledBatch) -> RunOutput: ...


class Engine:
    """Continuous batching over a paged KV cache: ``add_request``/``abort`` between steps, ``step`` to run."""

    def __init__(
        self, runner: Runner, config: WorkerConfig, kv_store: Callable[[BlockManager], KVStore] | None = None
    ) -> None:
        """``kv_store``: links the block manager to a KV store (worker/build.py), when there is one."""
        config = config.for_device(runner.device_type)
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, config.block_size, config.prefix_caching)
        self.kv_store = kv_store(self.blocks) if kv_store is not None else None
        self.max_model_len = runner.max_model_len
        self.loras: LoraRegistry | None = getattr(runner, "loras", None)  # LoRA adapters, where the runner applies them
        self.speculator = Speculator(config.speculate, self.blocks, self.max_model_len, config.max_num_batched_tokens)
        self.scheduler = Scheduler(
            self.blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.max_model_len,
            config.max_prefill_chunk,
            self.speculator,
            self.kv_store,
            config.max_encoder_images_per_step,
        )
        self.scheduler.max_loras = self.loras.max_loras if self.loras is not None else 0
        self.max_num_seqs = config.max_num_seqs
        # Pooling requests (embeddings, scores): run beside the batch in each step, with no KV blocks.
        self.pooling = PoolingQueue(
            getattr(runner, "pooling", None),
            runner.vocab_size,
            self.max_model_len,
            config.max_num_batched_tokens,
            self.max_num_seqs,
            config.max_prefill_chunk,
            config.pooling_share,
        )
        self._rejected: list[RequestOutput] = []
        self._requests: dict[str, Request] = {}
        self.num_steps = 0
        self.peak_batch_size = 0
        self._recent_tokens: deque[tuple[float, int]] = deque()  # (when, tokens) of the steps in the last 10 s
        self._recent_sum = 0  # their tokens: load() is read at every hand-over of the engine, so O(1)

    def add_request(self, new: NewRequest) -> None:
        """Queue a request; one that can never fit, or names tokens the model does not have, is
        answered with an error at the next step (never let into a batch it would break)."""
        problem = self.pooling.check(new)  # a generation request to a pooling model, or a bad pooling one
        if problem is not None:
            self.reject(new.request_id, problem, len(new.prompt_token_ids), bad_request=True)
            return
        if new.pooling is not None:
            self.pooling.add(new)
            return
        request = Request.from_wire(new, self.runner.eos_token_ids)
        if request.events is not None:
            request.record("admitted", prompt_tokens=request.num_prompt_tokens)
        if new.lora is not None:
            request.lora = self.loras.get(new.lora) if self.loras is not None else None
            if request.lora is None:
                why = f"the model `{new.lora}` does not exist (no LoRA adapter of that name on this worker)"
                self.reject(new.request_id, why, request.num_prompt_tokens, bad_request=True, traced=request)
                return
        error = self._check(request)
        if error is not None:
            self.reject(new.request_id, error, request.num_prompt_tokens, traced=request)
            return
        invalid = self._invalid_ids(new)
        if invalid is not None:
            self.reject(new.request_id, invalid, request.num_prompt_tokens, bad_request=True, traced=request)
            return
        try:
            self.runner.add_request(request)
        except GrammarError as exc:
            self.reject(new.request_id, str(exc), request.num_prompt_tokens, bad_request=True, traced=request)
            return
        except Exception as exc:  # e.g. a seed the generator refuses: this request's fault
            self.runner.remove_request(request)
            self.reject(
                new.request_id,
                f"the worker could not take the request: {type(exc).__name__}: {exc}",
                request.num_prompt_tokens,
                bad_request=True,
                traced=request,
            )
            return
        self._requests[request.request_id] = request
        self.scheduler.add(request)
        if self.kv_store is not None and request.lora is None:  # the store's keys know no adapters
            self.kv_store.lookup(request, self.blocks.cached_prefix_blocks(request))
        log.info(
            "request %s queued: %d prompt tokens, up to %d new",
            request.request_id,
            request.num_prompt_tokens,
            request.max_new_tokens,
            extra={"request_id": request.request_id},
        )

    def reject(
        self,
        request_id: str,
        error: str,
        num_prompt_tokens: int = 0,
        bad_request: bool = False,
        traced: Request | None = None,
    ) -> None:
        """Answer a request that will not run with an error (sent with the next step's outputs);
        ``traced``: the refused request, whose trace events (if it has any) go along."""
        log.warning("request %s refused: %s", request_id, error, extra={"request_id": request_id})
        events: list[WorkerEvent] = []
        if traced is not None and traced.events is not None:
            traced.record("finished", finish_reason=FinishReason.ERROR, output_tokens=0)
            events = traced.take_events()
        self._rejected.append(
            RequestOutput(
                request_id,
                [],
                FinishReason.ERROR,
                num_prompt_tokens,
                error=error,
                bad_request=bad_request,
                events=events,
            )
        )

    def _invalid_ids(self, new: NewRequest) -> str | None:
        """Token ids must index the vocabulary, in every field that carries them: one out of range
        (999999, 2**63) would fail the step of the whole batch, not just this request."""
        vocab = self.runner.vocab_size
        fields = {
            "prompt": new.prompt_token_ids,
            "stop_token_ids": new.stop_token_ids,
            "logit_bias": new.sampling.logit_bias,
        }
        for name, ids in fields.items():
            if any(not 0 <= t < vocab for t in ids):
                return f"{name} names a token outside the vocabulary (0 to {vocab - 1})"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(new.sampling, name)
            if k is not None and not 0 <= k <= vocab:
                return f"{name} must be between 0 and the vocabulary size ({vocab})"
        return None

    def _check(self, request: Request) -> str | None:
        if request.request_id in self._requests:
            return f"request id {request.request_id} is already running"
        if request.num_prompt_tokens == 0:
            return "the prompt is empty"
        if request.max_new_tokens < 1:
            return "max_new_tokens must be at least 1"
        total = request.max_total_tokens
        if total > self.max_model_len:
            return f"prompt ({request.num_prompt_tokens}) + max tokens ({request.max_new_tokens}) exceeds the context length ({self.max_model_len})"
        if blocks_for(total, self.blocks.block_size) > self.blocks.num_blocks:
            return (
                f"prompt + max tokens ({total}) exceeds this worker's KV cache ({self.blocks.capacity_tokens} tokens)"
            )
        return None

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        aborted = self.scheduler.finish(set(request_ids), RequestStatus.FINISHED_ABORTED)
        pooled = [ended(r, None, FinishReason.ABORT) for r in self.pooling.remove(set(request_ids))]
        return [self._finish_output(r, []) for r in aborted] + pooled

    def fail_all(self, message: str) -> list[RequestOutput]:
        """After an error inside a step: end every request with the error and leave the cache empty."""
        failed = self.scheduler.finish(set(self._requests), RequestStatus.FINISHED_ERROR)
        for request in failed:
            request.error = message
        pooled = [ended(r, message) for r in self.pooling.remove({r.request_id for r in self.pooling.waiting})]
        return [self._finish_output(r, []) for r in failed] + pooled

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._rejected) or bool(self.pooling.waiting)

    def step(self) -> StepOutputs:
        """Schedule a batch, run the model once over it, and report what each request gained."""
        outputs, self._rejected = self._rejected, []
        batch = self.scheduler.schedule()
        # Pooling rows share the step's budget with the batch, run beside it, and finish in this step.
        rows = self.pooling.take(batch.total_tokens, len(batch)) if batch else self.pooling.take()
        outputs += self.pooling.run(self.runner.pool, rows) if rows else []
        pooled_tokens = sum(len(r.prompt_token_ids) for r in rows)
        if not batch:
            if rows:
                self.pooling.settle(0.0)
                self._count_step(len(rows), pooled_tokens)
            return StepOutputs(outputs, batch_size=len(rows), num_tokens=pooled_tokens)
        size, num_tokens = len(batch), batch.total_tokens
        started = time.perf_counter()
        result, culprits = run_isolating(self.runner.execute, batch)
        self.pooling.settle(time.perf_counter() - started)
        outputs += self._fail_alone(culprits, size)
        batch = batch.without(culprits)
        before = [r.num_tokens for r in batch.requests]
        finished = set(self.scheduler.update(batch, result.sampled))
        outputs += self._outputs(batch, before, finished, result)
        self._count_step(size + len(rows), result.num_tokens + pooled_tokens)
        return StepOutputs(outputs, batch_size=size + len(rows), num_tokens=num_tokens + pooled_tokens)

    def _outputs(
        self, batch: ScheduledBatch, before: list[int], finished: set[Request], result: RunOutput
    ) -> list[RequestOutput]:
        """Each request's new tokens (a stop or the length limit may cut a verified run short)."""
        outputs = []
        for request, start in zip(batch.requests, before):
            new_tokens = request.token_ids[start:]
            lp = result.logprobs.get(request.request_id)
            lp = None if lp is None else lp[: len(new_tokens)]
            if request in finished:
                outputs.append(self._finish_output(request, new_tokens, lp))
            elif new_tokens:
                outputs.append(self._output(request, new_tokens, lp))
        return outputs

    def _fail_alone(self, culprits: dict[str, Exception], batch_size: int) -> list[RequestOutput]:
        """End the requests whose rows failed the step alone (worker/isolation.py); the rest go on."""
        outputs = []
        for request in self.scheduler.finish(set(culprits), RequestStatus.FINISHED_ERROR):
            failure = culprits[request.request_id]
            request.error = f"step failed: {type(failure).__name__}: {failure}"
            log.error(
                "request %s failed its step alone (%s); ended it, %d others go on",
                request.request_id,
                request.error,
                batch_size - len(culprits),
                extra={"request_id": request.request_id},
            )
            outputs.append(self._finish_output(request, []))
        return outputs

    def _output(
        self, request: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> RequestOutput:
        prompt = None
        if new_token_ids and request.sampling.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt, request.prompt_logprobs_sent = request.prompt_logprobs, True  # complete once a token is sampled
        request.outputs_sent += 1
        return RequestOutput(
            request.request_id,
            new_token_ids,
            request.finish_reason,
            request.num_prompt_tokens,
            request.num_output_tokens,
            request.num_cached_tokens,
            error=request.error,
            logprobs=logprobs,
            prompt_logprobs=prompt,
            seq=request.outputs_sent - 1,
            events=request.take_events(),
        )

    def _finish_output(
        self, request: Request, new_token_ids: list[int], logprobs: list[TokenLogprobs] | None = None
    ) -> RequestOutput:
        log.info(
            "request %s %s: %d generated, %d prompt tokens from the prefix cache",
            request.request_id,
            request.finish_reason,
            request.num_output_tokens,
            request.num_cached_tokens,
            extra={"request_id": request.request_id, "finish_reason": request.finish_reason},
        )
        if request.events is not None:
            request.record(
                "finished", finish_reason=request.finish_reason or "", output_tokens=request.num_output_tokens
            )
        del self._requests[request.request_id]
        self.runner.remove_request(request)
        return self._output(request, new_token_ids, logprobs)

    def _count_step(self, batch_size: int, num_sampled: int) -> None:
        self.num_steps += 1
        self.peak_batch_size = max(self.peak_batch_size, batch_size)
        now = time.monotonic()
        self._recent_tokens.append((now, num_sampled))
        self._recent_sum += num_sampled
        self._forget_old_steps(now)

    def _forget_old_steps(self, now: float) -> None:
        while self._recent_tokens and self._recent_tokens[0][0] < now - 10.0:
            self._recent_sum -= self._recent_tokens.popleft()[1]

    def load(self) -> Heartbeat:
        """Load figures for the gateway: queue lengths, free KV blocks, recent tokens/s."""
        self._forget_old_steps(time.monotonic())
        return Heartbeat(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting) + len(self.pooling.waiting),
            free_blocks=self.blocks.num_free_blocks,
            total_blocks=self.blocks.num_blocks,
            tokens_per_s=self._recent_sum / 10.0,
            steps=self.num_steps,
            peak_batch_size=self.peak_batch_size,
            preemptions=self.scheduler.num_preemptions,
            prefix_hit_tokens=self.blocks.hit_tokens,
            prefix_queried_tokens=self.blocks.queried_tokens,
            cached_blocks=self.blocks.num_cached_blocks,
            spec_proposed_tokens=self.speculator.proposed_tokens,
            spec_accepted_tokens=self.speculator.accepted_tokens,
            **(self.kv_store.figures() if self.kv_store is not None else {}),
            lora=lora_load(self.loras, self.scheduler) if self.loras is not None else None,
        )
