"""A model runner without a model, for the engine's tests: each sampled row's next token is the one
after its last (mod the vocabulary), and rows named in ``poison`` make any step that holds them fail."""

from __future__ import annotations

from worker.request import Request
from worker.scheduler import RunOutput, ScheduledBatch


class FakeRunner:
    device_type = "cpu"

    def __init__(self, num_blocks: int = 64, max_model_len: int = 1024, vocab_size: int = 1000, eos: int = 0) -> None:
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset({eos})
        self.poison: set[str] = set()
        self.added: set[str] = set()
        self.batches: list[list[tuple[str, int]]] = []  # (request id, tokens) of every batch executed

    def add_request(self, request: Request) -> None:
        self.added.add(request.request_id)

    def remove_request(self, request: Request) -> None:
        self.added.discard(request.request_id)

    def execute(self, batch: ScheduledBatch) -> RunOutput:
        self.batches.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)])
        if any(r.request_id in self.poison for r in batch.requests):
            raise IndexError("poisoned row")
        out = RunOutput()
        for request, n in zip(batch.requests, batch.num_new_tokens):
            if request.num_computed_tokens + n >= request.num_tokens:  # the prompt is done (or drafts follow): sample
                out.sampled[request.request_id] = [(request.token_ids[-1] + 1) % self.vocab_size or 1]
        return out
