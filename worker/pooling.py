"""Pooling requests in the engine: checked on arrival, queued, and run beside the generation batch
in the same step, as prefill-only rows that keep no KV blocks (the scheduler and the block manager
never see them, so the prefix cache is untouched). Each finishes in the step that runs it, with one
output carrying its vector.

Beside generation they get a share of the step time (``--pooling-share``), not a row in every
step: a pooling row runs whole, in the torch forward (45-85 ms for 128 tokens on 2 CPU cores),
where a decode-only step is the C++ step's 6-10 ms, so a row in every step held chat streams to
the pooling pace (0.12x their throughput alone). Generation's seconds earn pooling credit, pooling's
seconds spend it (deficit round robin); pooling rows join a step with credit left, and always run
when nothing generates.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from common.pooling import PoolingInfo, PoolingTask
from common.protocol import FinishReason, NewRequest, RequestOutput

log = logging.getLogger(__name__)

Pool = Callable[[list[NewRequest]], list[bytes]]

MAX_CREDIT_S = 0.1  # pooling credit saved up while chat alone ran: about one pooling row's time, no burst


class PoolingQueue:
    """The pooling requests waiting for a step, and running them through the runner's ``pool``."""

    def __init__(
        self,
        info: PoolingInfo | None,
        vocab_size: int,
        max_model_len: int,
        max_tokens: int,
        max_rows: int,
        chunk: int,
        share: float,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"--pooling-share must be in (0, 1]; got {share}")
        self.info = info
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens  # a step's token budget (--max-num-batched-tokens)
        self.max_rows = max_rows
        self.chunk = chunk  # most pooling tokens beside a running batch (--max-prefill-chunk): its streams' pace holds
        self.share = share  # most of the step time pooling rows take beside generation
        self.waiting: deque[NewRequest] = deque()
        self._credit = 0.0  # seconds pooling rows may still take beside generation (their own runs spend it)

    def check(self, new: NewRequest) -> str | None:
        """Why this worker cannot run ``new`` (the request's own fault), or None."""
        params = new.pooling
        if params is None:
            return (
                None
                if self.info is None or PoolingTask.GENERATE in self.info.tasks
                else "this model is a pooling model (embeddings and scores); it does not generate text"
            )
        if self.info is None or params.task not in self.info.tasks:
            tasks = ", ".join(self.info.tasks) if self.info is not None else PoolingTask.GENERATE
            return f"this model does not do `{params.task}` (it does: {tasks})"
        ids = new.prompt_token_ids
        if not ids:
            return "the input is empty"
        if len(ids) > self.max_model_len:
            return f"the input has {len(ids)} tokens, more than this model's limit of {self.max_model_len}"
        if any(not 0 <= t < self.vocab_size for t in ids):
            return f"the input names a token outside the vocabulary (0 to {self.vocab_size - 1})"
        if params.dimensions is not None and not (
            self.info.matryoshka and 0 < params.dimensions <= self.info.dimensions
        ):
            return f"`dimensions` {params.dimensions} is not one this model gives (it is not Matryoshka, or has {self.info.dimensions})"
        return None

    def add(self, new: NewRequest) -> None:
        self.waiting.append(new)

    def take(self, used_tokens: int = 0, used_rows: int = 0) -> list[NewRequest]:
        """This step's rows, the oldest first: beside a batch (``used_*``), within what it left of the
        step's budget and at most ``chunk`` tokens, as prompt chunks beside decodes are; alone, the
        whole budget. Always at least one, so neither long prompts nor busy streams starve them;
        beside a batch only while they have credit (the module docstring)."""
        rows: list[NewRequest] = []
        if used_rows and self._credit < 0:
            return rows
        tokens = used_tokens
        budget = min(self.max_tokens, used_tokens + self.chunk) if used_rows else self.max_tokens
        while self.waiting and (not rows or used_rows + len(rows) < self.max_rows):
            size = len(self.waiting[0].prompt_token_ids)
            if rows and tokens + size > budget:
                break
            rows.append(self.waiting.popleft())
            tokens += size
        return rows

    def remove(self, request_ids: set[str]) -> list[NewRequest]:
        """Take these requests out of the queue (aborted, or failed with the worker)."""
        gone = [r for r in self.waiting if r.request_id in request_ids]
        if gone:
            self.waiting = deque(r for r in self.waiting if r.request_id not in request_ids)
        return gone

    def settle(self, generation_s: float) -> None:
        """After a step: its generation earns credit (pooling rows that ran alone owe none: nothing
        else wanted the time)."""
        if self.share >= 1.0 or generation_s <= 0.0:
            self._credit = 0.0
            return
        self._credit = min(MAX_CREDIT_S, self._credit + generation_s * self.share / (1.0 - self.share))

    def run(self, pool: Pool, rows: list[NewRequest]) -> list[RequestOutput]:
        """Each row's output, its time spent from the credit."""
        started = time.perf_counter()
        try:
            return self._run(pool, rows)
        finally:
            self._credit -= time.perf_counter() - started

    def _run(self, pool: Pool, rows: list[NewRequest]) -> list[RequestOutput]:
        """Each row's output; when the batch fails, each row runs alone, so only a culprit fails."""
        try:
            return [done(row, vector) for row, vector in zip(rows, pool(rows))]
        except Exception as exc:  # one request must not fail the others
            if len(rows) == 1:
                log.error("pooling request %s failed: %s: %s", rows[0].request_id, type(exc).__name__, exc)
                return [ended(rows[0], f"step failed: {type(exc).__name__}: {exc}")]
            log.warning("a pooling batch of %d failed (%s); running its rows alone", len(rows), exc)
            return [out for row in rows for out in self.run(pool, [row])]


def done(row: NewRequest, vector: bytes) -> RequestOutput:
    return RequestOutput(row.request_id, [], FinishReason.STOP, len(row.prompt_token_ids), pooled=vector)


def ended(row: NewRequest, error: str | None, finish: str = FinishReason.ERROR) -> RequestOutput:
    return RequestOutput(row.request_id, [], finish, len(row.prompt_token_ids), error=error)
