"""What the generation core hands back to the dialects: a choice's events as they come (``Event``:
``PromptLogprobs``, ``Thinking``, ``Text``, ``ToolCallDelta``, then one ``Finish``), or the choice
whole (``Choice``), and the usage they add up to. gateway/generate/core.py makes them; each route under
gateway/http/routes translates them into its dialect's shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.protocol import TokenLogprobs
from gateway.generate.logprobs import TokenLogprob
from gateway.generate.tools import CallDelta, ToolCall

# Why a choice ended, in the core's words (each dialect names them its own way):
END = "stop"  # the model ended it (end-of-sequence, a stop token)
STOP_SEQUENCE = "stop_sequence"  # a stop string ended it (``Finish.stop_sequence`` says which)
LENGTH = "length"  # the token budget (max_tokens) or the context ran out
TOOL_CALLS = "tool_calls"  # it ended having called tools


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    reasoning_tokens: int = 0  # of the completion tokens, those of the thinking (its markers included)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Text:
    index: int
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of the tokens behind this text, when asked for


@dataclass(slots=True)
class Thinking:
    """New text of a reasoning model's thinking (never part of ``Text``)."""

    index: int
    text: str


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    call: CallDelta


@dataclass(slots=True)
class PromptLogprobs:
    index: int
    logprobs: list[tuple[int, TokenLogprobs | None]]  # every prompt token's (the first has none)


@dataclass(slots=True)
class Finish:
    index: int
    reason: str  # END, STOP_SEQUENCE, LENGTH or TOOL_CALLS
    usage: Usage
    stop_sequence: str | None = None


Event = Text | Thinking | ToolCallDelta | PromptLogprobs | Finish


@dataclass(slots=True)
class Choice:
    """One generation, whole."""

    index: int
    text: str = ""  # what is not tool calls (nor thinking)
    reasoning: str = ""  # a reasoning model's thinking
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[tuple[int, TokenLogprobs | None]] = field(default_factory=list)
    finish: Finish | None = None

    @property
    def content(self) -> str | None:
        """The text as a message's content: None when there is only a tool call."""
        if not self.tool_calls:
            return self.text
        return self.text.strip() or None


def total_usage(finishes: list[Finish], n: int = 1) -> Usage:
    """Usage of all choices; each prompt counts once however many choices (``n``) it had."""
    prompts = [f.usage for f in finishes[::n]]
    return Usage(
        sum(u.prompt_tokens for u in prompts),
        sum(f.usage.completion_tokens for f in finishes),
        sum(u.cached_tokens for u in prompts),
        sum(f.usage.reasoning_tokens for f in finishes),
    )
