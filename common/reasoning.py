"""A reasoning model's thinking, token by token: the one state machine the worker enforces (budget,
grammar after the thinking) and the gateway counts (reasoning tokens) with.

A generation starts where the prompt left it (``ThinkState``): thinking already opened by the
template (DeepSeek-R1's ``<think>\\n``), closed by it (Qwen3 with ``enable_thinking`` false), or
neither, when the model may open it with its first tokens (Qwen3). A marker is a sequence of token
ids: one token in most reasoning vocabularies, several where the vocabulary lacks it (``<thinking>``
as ``<``, ``thinking``, ``>``), matched as the tokens arrive, one step or several at a time.
"""

from __future__ import annotations

from enum import IntEnum

from common.protocol import Reasoning


class ThinkState(IntEnum):
    PENDING = 0  # the first token decides: the start marker opens the thinking, anything else answers
    THINKING = 1
    ANSWER = 2


# How near the prompt's end a closing marker means the template closed the thinking (Qwen3's
# ``<think>\n\n</think>\n\n`` when thinking is off) rather than an earlier turn's.
CLOSED_TAIL = 8


def initial_state(prompt: list[int], start: list[int], end: list[int], assume_thinking: bool) -> ThinkState:
    """Where the prompt leaves the thinking: opened last (THINKING), closed at its very end (ANSWER),
    else THINKING when the model is known to omit the start marker (DeepSeek-R1), or PENDING."""
    last_start, last_end = _last(prompt, start), _last(prompt, end)
    if last_start > last_end:
        return ThinkState.THINKING
    if last_end >= 0 and last_end + len(end) - 1 >= len(prompt) - CLOSED_TAIL:
        return ThinkState.ANSWER
    return ThinkState.THINKING if assume_thinking else ThinkState.PENDING


def _last(tokens: list[int], marker: list[int]) -> int:
    """Where the last occurrence of ``marker`` starts in ``tokens`` (-1: nowhere)."""
    first, size = marker[0], len(marker)
    for i in range(len(tokens) - size, -1, -1):
        if tokens[i] == first and tokens[i : i + size] == marker:
            return i
    return -1


def _advance(marker: list[int], matched: int, token: int) -> int:
    """How much of ``marker`` the tokens end with, after ``token`` follows ``matched`` of them (a
    mismatch may still leave a shorter start matched, as in string search)."""
    seen = [*marker[:matched], token]
    for size in range(len(seen), 0, -1):
        if seen[-size:] == marker[:size]:
            return size
    return 0


class ThinkTracker:
    """One request's thinking, advanced by each generated token."""

    __slots__ = ("spec", "state", "thinking_tokens", "reasoning_tokens", "matched")

    def __init__(self, spec: Reasoning) -> None:
        self.spec = spec
        self.state = ThinkState(spec.state)
        self.thinking_tokens = 0  # inside the thinking, markers excluded: what the budget counts
        self.reasoning_tokens = 0  # markers included: what usage reports
        self.matched = 0  # tokens of the marker under way (PENDING: the start one; THINKING: the end one)

    def forced(self) -> int | None:
        """The token the next step must produce: the end marker's next once the budget is spent (a
        marker the model had begun is finished, not begun again)."""
        budget = self.spec.budget
        if self.state == ThinkState.THINKING and budget is not None and self.thinking_tokens >= budget:
            return self.spec.end_token_ids[self.matched]
        return None

    def answers(self, token: int) -> bool:
        """Whether ``token``, sampled next, belongs to the answer (a grammar constrains only those)."""
        if self.state == ThinkState.PENDING:
            return token != self.spec.start_token_ids[self.matched]
        return self.state == ThinkState.ANSWER

    def opening(self) -> int | None:
        """The start marker's next token while the model may still open its thinking (a grammar
        must allow it too), else None."""
        return self.spec.start_token_ids[self.matched] if self.state == ThinkState.PENDING else None

    def push(self, token: int) -> None:
        """Advance by a generated token."""
        if self.state == ThinkState.PENDING:
            start = self.spec.start_token_ids
            if token != start[self.matched]:  # the answer began (with any start-marker tokens before)
                self.state, self.matched = ThinkState.ANSWER, 0
            elif self.matched + 1 < len(start):
                self.matched += 1
            else:
                self.state, self.matched = ThinkState.THINKING, 0
                self.reasoning_tokens += len(start)
        elif self.state == ThinkState.THINKING:
            end = self.spec.end_token_ids
            matched = _advance(end, self.matched, token)
            self.thinking_tokens += 1 + self.matched - matched  # tokens that turned out not to be the marker
            self.reasoning_tokens += 1
            self.state, self.matched = (ThinkState.ANSWER, 0) if matched == len(end) else (self.state, matched)

    def answer_tokens(self, tokens: list[int]) -> list[int]:
        """Push ``tokens`` (generated before a resume) and return those that were the answer's."""
        answer = []
        for token in tokens:
            if self.answers(token):
                answer.append(token)
            self.push(token)
        return answer
