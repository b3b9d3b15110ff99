"""Speculative decoding for a lone stream: n-gram (prompt-lookup) drafts, verified in one step.

Why: with one request running, a decode step on the CPU is bound by reading the weights once; a step
that computes the last token plus k guessed ones reads them once too, so every guess the model
confirms is a token almost for free. The guesses need no draft model: the last n tokens (n = 3, 2,
1) are looked up earlier in prompt + output, and the up-to-k tokens that followed them there are
proposed (TGI's ``--speculate`` with n-gram drafts, vLLM's ``ngram`` method, "prompt lookup
decoding"). They pay off when the output repeats its input: editing, summarising, code, lists.

The verifying step runs the drafts as extra query positions over the request's own blocks; the
sampler keeps the longest prefix the target agrees with, plus one token of its own (see
``Sampler.verify``). Keys and values written for rejected positions lie past the request's computed
tokens, so the next step overwrites them and the prefix cache (which hashes only blocks full of
computed tokens) never sees them.

Which requests speculate: greedy ones (output token-identical to plain decoding) and sampled ones
without a seed (rejection sampling keeps the target distribution exactly). Guided requests (their
grammar advances one token at a time) and seeded sampled ones (their random stream would depend on
how many drafts were accepted, so output would no longer follow from the seed alone) decode plainly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from worker.block_manager import BlockManager
from worker.request import Request

if TYPE_CHECKING:
    from worker.scheduler import ScheduledBatch

MAX_NGRAM = 3
MIN_NGRAM = 1


def propose(token_ids: list[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying the longest n first; empty when no suffix recurs."""
    length = len(token_ids)
    if k < 1 or length < min_ngram + 1:
        return []
    tokens = np.asarray(token_ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        # Candidate starts i in [0, length - n): the match is tokens[i:i+n], followed by at least one token.
        starts = length - n
        match = tokens[:starts] == tokens[starts]
        for j in range(1, n):
            match &= tokens[j : starts + j] == tokens[starts + j]
        found = np.flatnonzero(match)
        if found.size:
            follow = int(found[-1]) + n
            return tokens[follow : follow + k].tolist()
    return []


def may_speculate(request: Request) -> bool:
    """Greedy or unseeded sampled, not guided, no LoRA adapter (drafts verify on the C++ step), and no thinking budget to force an end marker at
    (see the module docstring)."""
    sampling = request.sampling
    budgeted = request.reasoning is not None and request.reasoning.spec.budget is not None
    return (
        request.guide is None
        and request.lora is None
        and not budgeted
        and (sampling.temperature == 0 or sampling.seed is None)
    )


class Speculator:
    """Gives a lone decoding request its drafts (and the blocks to verify them in); keeps the counts."""

    def __init__(
        self, num_speculative: int, blocks: BlockManager, max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        if num_speculative < 0:
            raise ValueError(f"--speculate must be 0 (off) or more; got {num_speculative}")
        self.k = min(num_speculative, max_num_batched_tokens - 1)
        self.blocks = blocks
        self.max_model_len = max_model_len
        self.proposed_tokens = 0
        self.accepted_tokens = 0

    def draft(self, batch: ScheduledBatch) -> None:
        """When the batch is one request decoding one token, propose drafts and widen its row to them.

        Drafts never reach past ``max_tokens`` or the context length, so a fully accepted run ends
        the request exactly where plain decoding would. No block is free for them: no drafts.
        """
        if self.k == 0 or len(batch) != 1 or batch.num_new_tokens[0] != 1:
            return
        request = batch.requests[0]
        if request.num_computed_tokens + 1 != request.num_tokens or not may_speculate(request):
            return
        limit = min(
            self.k, request.max_new_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens - 1
        )
        drafts = propose(request.token_ids, limit)
        if not drafts or not self.blocks.allocate(request, 1 + len(drafts)):
            return
        request.draft_token_ids = drafts
        batch.num_new_tokens[0] = 1 + len(drafts)
        self.proposed_tokens += len(drafts)

    def verified(self, num_emitted: int) -> None:
        """A verify step emitted ``num_emitted`` tokens: all but the last were accepted drafts."""
        self.accepted_tokens += num_emitted - 1
