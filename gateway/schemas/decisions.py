"""OpenAI's Decisions API bodies (``POST /v1/decisions``, public beta): typed questions over one
input, answered with probabilities."""

from __future__ import annotations

import msgspec


class DecisionOption(msgspec.Struct, kw_only=True):
    value: str | bool  # typed: the string "true" and the boolean true are distinct choices
    description: str | None = None


class ScoreLevel(msgspec.Struct, kw_only=True):
    label: str
    description: str | None = None


class DecisionQuestion(msgspec.Struct, kw_only=True):
    type: str  # predicate | choice | score
    instructions: str
    name: str | None = None
    choices: list[DecisionOption] | None = None  # a choice question's options (2 to 52 here)
    levels: list[ScoreLevel] | None = None  # a score question's levels, lowest first (2 to 10)


class DecisionRequest(msgspec.Struct, kw_only=True):
    model: str
    input: str | list[dict]  # text, or user messages of input_text parts
    questions: list[DecisionQuestion]
    safety_identifier: str | None = None  # accepted and ignored (docs/api/fields.md)
