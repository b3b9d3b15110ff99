"""Guided decoding: a grammar per request, applied as a token mask inside the batched step.

Each guided request owns an llguidance matcher. Before sampling, the matchers of the guided rows
fill one bitmask (a bit per vocabulary entry); allowed tokens keep their logits, the rest become
-inf, so guided and free requests share the batch and free rows are never touched. After sampling,
each matcher consumes its row's token. Once the grammar is complete the mask allows only the
end-of-sequence tokens, so the request stops the ordinary way. A reasoning model's grammar starts
after its thinking (common/reasoning.py): thinking rows are not masked and their tokens not
consumed, and a row that may still open its thinking may also take the start marker (all of it,
once begun, when the marker is several tokens).

llguidance was chosen over xgrammar by measurement on this machine (default model's tokenizer, a
3-field JSON schema; scripts in the commit message): both compute a mask in well under 0.1 ms
(llguidance median 0.009 ms, xgrammar 0.003 ms) against a 15-60 ms step, so footprint decided:
llguidance is one 7.6 MB wheel with no dependencies; xgrammar needs apache-tvm-ffi and, on Linux,
triton (a 286 MB wheel).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from common.grammar import GrammarError, grammar_text
from common.reasoning import ThinkState, ThinkTracker
from worker.request import Request

log = logging.getLogger(__name__)


class GuidedDecoding:
    """The matchers of the guided requests.

    llguidance's view of the tokenizer takes about 3 s to build. Built on the first guided request,
    it stalled the worker's loop (no heartbeats) long enough for a gateway with a short liveness to
    declare the worker dead; so a background thread builds it from the start, and the first guided
    request waits only for what is left.
    """

    def __init__(self, load_tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="guided-tokenizer")
        self._lltokenizer: Future = builder.submit(self._build_tokenizer)
        builder.shutdown(wait=False)
        self._matchers: dict[str, Any] = {}

    def _build_tokenizer(self) -> Any:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(
            self._load_tokenizer(), n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
        )

    def _tokenizer(self) -> Any:
        return self._lltokenizer.result()

    def add(self, request: Request) -> None:
        """Compile the request's grammar and replay tokens it generated before a resume; raise
        GrammarError when the grammar is invalid."""
        import llguidance

        assert request.guide is not None
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar_text(request.guide), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the grammar does not compile: {matcher.get_error()}")
        generated = request.generated_token_ids
        if request.reasoning is not None:  # the grammar starts after the thinking
            generated = ThinkTracker(request.reasoning.spec).answer_tokens(generated)
        if generated and not matcher.consume_tokens(generated):
            raise GrammarError(f"the tokens generated before the resume do not fit the grammar: {matcher.get_error()}")
        self._matchers[request.request_id] = matcher

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def mask(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Logits with every token the grammar forbids at -inf, for the guided rows only."""
        if not self._matchers:
            return logits
        rows = [
            (i, m)
            for i, r in enumerate(requests)
            if (m := self._matchers.get(r.request_id)) is not None and not m.is_error() and _constrained(r)
        ]
        if not rows:
            return logits
        # llguidance.numpy, not llguidance.torch: importing the latter imports torch's compiler
        # (3.4 s here, inside the first guided step) for a kernel this module does not use.
        import llguidance.numpy as lln

        bitmask = lln.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, (_, matcher) in enumerate(rows):
            lln.fill_next_token_bitmask(matcher, bitmask, j)
        index = torch.tensor([i for i, _ in rows], device=logits.device)
        allowed = _unpack(torch.from_numpy(bitmask), logits.shape[-1]).to(logits.device)
        for j, (i, _) in enumerate(rows):  # a model that may still open its thinking may do so
            think = requests[i].reasoning
            if think is not None and (token := think.opening()) is not None:
                if think.matched:  # a start marker of several tokens, begun: the grammar never saw it, so finish it
                    allowed[j] = False
                allowed[j, token] = True
        guided = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, index, guided)

    def accept(self, requests: list[Request], tokens: list[int]) -> None:
        """Advance each guided request's matcher by its sampled token."""
        if not self._matchers:
            return
        for request, token in zip(requests, tokens):
            matcher = self._matchers.get(request.request_id)
            if matcher is None or request.reasoning is not None and not request.reasoning.answers(token):
                continue  # thinking: the grammar has not started
            if not matcher.consume_token(token):
                log.warning(
                    "request %s: token %d rejected by its grammar: %s",
                    request.request_id,
                    token,
                    matcher.get_error(),
                    extra={"request_id": request.request_id},
                )


def _constrained(request: Request) -> bool:
    """The grammar applies: no thinking, or it is over (or may not come: the model may still open it)."""
    think = request.reasoning
    return think is None or think.state != ThinkState.THINKING


_BITS = torch.arange(32, dtype=torch.int32)


def _unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[rows, words]`` int32 bitmask -> ``[rows, vocab]`` booleans (True: allowed)."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.flatten(1)[:, :vocab].bool()
