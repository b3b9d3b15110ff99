"""A reasoning model's thinking, token by token: the one state machine the worker enforces (budget,
grammar after the thinking) and the gateway counts (reasoning tokens) with.

A generation starts where the prompt left it (``ThinkState``): thinking already opened by the
template (DeepSeek-R1's ``<think>\\n``), closed by it (Qwen3 with ``enable_thinking`` false), or
neither, when the model may open it with its first token (Qwen3). Markers are single tokens, as in
every reasoning model's vocabulary this was written for.
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


def initial_state(prompt: list[int], start: int, end: int, assume_thinking: bool) -> ThinkState:
    """Where the prompt leaves the thinking: opened last (THINKING), closed at its very end (ANSWER),
    else THINKING when the model is known to omit the start marker (DeepSeek-R1), or PENDING."""
    last_start = last_end = -1
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] == start and last_start < 0:
            last_start = i
        elif prompt[i] == end and last_end < 0:
            last_end = i
        if last_start >= 0 and last_end >= 0:
            break
    if last_start > last_end:
        return ThinkState.THINKING
    if last_end >= 0 and last_end >= len(prompt) - CLOSED_TAIL:
        return ThinkState.ANSWER
    return ThinkState.THINKING if assume_thinking else ThinkState.PENDING


class ThinkTracker:
    """One request's thinking, advanced by each generated token."""

    __slots__ = ("spec", "state", "thinking_tokens", "reasoning_tokens")

    def __init__(self, spec: Reasoning) -> None:
        self.spec = spec
        self.state = ThinkState(spec.state)
        self.thinking_tokens = 0  # inside the thinking, markers excluded: what the budget counts
        self.reasoning_tokens = 0  # markers included: what usage reports

    def forced(self) -> int | None:
        """The token the next step must produce: the end marker once the budget is spent."""
        budget = self.spec.budget
        if self.state == ThinkState.THINKING and budget is not None and self.thinking_tokens >= budget:
            return self.spec.end_token_id
        return None

    def answers(self, token: int) -> bool:
        """Whether ``token``, sampled next, belongs to the answer (a grammar constrains only those)."""
        return self.state == ThinkState.ANSWER or self.state == ThinkState.PENDING and token != self.spec.start_token_id

    @property
    def may_open(self) -> bool:
        """The next token may be the start marker (a grammar must allow it too)."""
        return self.state == ThinkState.PENDING

    def push(self, token: int) -> bool:
        """Advance by a generated token; True when it is part of the reasoning."""
        if self.state == ThinkState.PENDING:
            self.state = ThinkState.THINKING if token == self.spec.start_token_id else ThinkState.ANSWER
        elif self.state == ThinkState.THINKING:
            if token == self.spec.end_token_id:
                self.state = ThinkState.ANSWER
            else:
                self.thinking_tokens += 1
        else:
            return False
        thinking = self.state == ThinkState.THINKING or token == self.spec.end_token_id
        self.reasoning_tokens += thinking
        return thinking

    def answer_tokens(self, tokens: list[int]) -> list[int]:
        """Push ``tokens`` (generated before a resume) and return those that were the answer's."""
        answer = []
        for token in tokens:
            if self.answers(token):
                answer.append(token)
            self.push(token)
        return answer
