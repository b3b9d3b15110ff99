"""Reasoning models: the thinking split out of the answer, and the thinking budget.

``--reasoning-parser`` picks the markers: ``deepseek_r1`` and ``qwen3`` both use ``<think>`` and
``</think>``; ``auto`` (the default) takes the first pair of known markers that the model's chat
template mentions; ``none`` splits nothing. A marker may be one token or several (a vocabulary
without ``<thinking>`` writes it as ``<``, ``thinking``, ``>``), and may be a special token (kept in
the text the split reads, though decoding skips special tokens). They differ where the output has
no start marker: DeepSeek-R1 omits it (its template opens the thinking), so ``deepseek_r1`` reads
text before ``</think>`` as thinking; Qwen3 writes it, so ``qwen3`` and ``auto`` read an answer
without one as all answer. Where the prompt itself leaves the thinking open or closed
(``enable_thinking``), that decides (common/reasoning.py's ``initial_state``).

The worker enforces the rest by token (common/reasoning.py): a budget ends the thinking with the end
marker's tokens, and a guide (``response_format``, a forced tool call) starts after them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from common.protocol import Reasoning
from common.reasoning import ThinkState, initial_state
from gateway.errors import InvalidRequest

log = logging.getLogger(__name__)

PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
MARKERS = (
    ("<think>", "</think>"),  # DeepSeek-R1, Qwen3, QwQ, GLM-4.5, SmolLM3...
    ("<thinking>", "</thinking>"),
    ("◁think▷", "◁/think▷"),  # Kimi
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
    ("[THINK]", "[/THINK]"),  # Magistral (special tokens)
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command A Reasoning (special tokens)
)
# ``reasoning_effort`` (OpenAI's names) as thinking-token budgets; max: no budget but max_tokens.
EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0,
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": 32768,
    "max": None,
}


@dataclass(slots=True, frozen=True)
class Markers:
    """A model's thinking markers, as text (the parser) and as token ids (the worker)."""

    start: str
    end: str
    start_ids: list[int]
    end_ids: list[int]
    assume_thinking: bool  # the model omits the start marker (DeepSeek-R1)
    special_ids: frozenset[int] = frozenset()  # the markers' special tokens: decoding must keep them

    def spec(self, prompt: list[int], budget: int | None) -> Reasoning:
        """The wire description of one prompt's thinking."""
        state = initial_state(prompt, self.start_ids, self.end_ids, self.assume_thinking)
        return Reasoning(self.start_ids, self.end_ids, state, budget)


def model_markers(parser: str, tokenizer: Any, template_source: str) -> Markers | None:
    """The markers ``parser`` gives this model, or None (no thinking to split)."""
    if parser == "none":
        return None
    for start, end in MARKERS if parser == "auto" else MARKERS[:1]:
        if parser == "auto" and start not in template_source:
            continue
        start_ids, end_ids = (tokenizer.encode(marker, add_special_tokens=False) for marker in (start, end))
        if len(start_ids) > 1 or len(end_ids) > 1:
            log.info("thinking markers %s and %s are %d and %d tokens", start, end, len(start_ids), len(end_ids))
        special = frozenset(start_ids + end_ids) & frozenset(tokenizer.all_special_ids)
        return Markers(start, end, start_ids, end_ids, parser == "deepseek_r1", special)
    return None


def thinking_budget(effort: str | None, budget: int | None, effort_param: str, budget_param: str) -> int | None:
    """The thinking-token budget a request asks for: an explicit budget, else its effort's."""
    if budget is not None:
        if budget < 0:
            raise InvalidRequest(f"`{budget_param}` must be 0 or more; got {budget}", param=budget_param)
        return budget
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise InvalidRequest(
            f"`{effort_param}` must be one of {', '.join(EFFORT_BUDGETS)}; got {effort!r}", param=effort_param
        )
    return EFFORT_BUDGETS[effort]


class ReasoningParser:
    """One choice's text split into thinking and answer, incrementally: ``push`` returns what is
    certain (a tail that may be the start of a marker is held back, as stop strings are), ``finish``
    the rest. Whitespace that opens the thinking or the answer after it is dropped."""

    def __init__(self, markers: Markers, state: int) -> None:
        self.markers = markers
        self.state = ThinkState(state)
        self._held = ""
        self._strip = self.state == ThinkState.THINKING  # at the start of a section: drop leading whitespace

    def push(self, text: str) -> tuple[str, str]:
        """New text -> (thinking, answer) that can be sent now."""
        thinking, answer, buffer = "", "", self._held + text
        self._held = ""
        while buffer:
            if self.state == ThinkState.PENDING:
                stripped = buffer.lstrip()
                if stripped.startswith(self.markers.start):
                    self.state, self._strip, buffer = ThinkState.THINKING, True, stripped[len(self.markers.start) :]
                    continue
                if self.markers.start.startswith(stripped):  # could still become the marker
                    self._held = buffer
                    return thinking, answer
                self.state = ThinkState.ANSWER
            if self.state == ThinkState.THINKING:
                if self._strip:
                    buffer = buffer.lstrip()
                    self._strip = not buffer
                cut = buffer.find(self.markers.end)
                if cut < 0:
                    keep = _partial_tail(buffer, self.markers.end)
                    self._held = buffer[len(buffer) - keep :]
                    return thinking + buffer[: len(buffer) - keep], answer
                thinking += buffer[:cut]
                self.state, self._strip, buffer = ThinkState.ANSWER, True, buffer[cut + len(self.markers.end) :]
                continue
            if self._strip:
                buffer = buffer.lstrip()
                self._strip = not buffer
            answer += buffer
            break
        return thinking, answer

    def finish(self) -> tuple[str, str]:
        """At the end of the generation: the held-back tail (it was no marker after all)."""
        held, self._held = self._held, ""
        return (held, "") if self.state == ThinkState.THINKING else ("", held)


def _partial_tail(buffer: str, marker: str) -> int:
    """Length of the longest end of ``buffer`` that starts ``marker``."""
    for size in range(min(len(marker) - 1, len(buffer)), 0, -1):
        if buffer.endswith(marker[:size]):
            return size
    return 0
