"""The Decisions core (OpenAI's ``POST /v1/decisions``): each question is asked in a chat prompt
that starts with the shared input, so every question reuses its cached KV blocks, and answered from
the probabilities of its label tokens at the answer position; nothing is generated.

Each label token's probability is read with one one-token request that forces that token
(``logit_bias`` +100) and asks for its logprob, which the worker takes from the raw distribution:
exact for any label, however unlikely, and the greedy answer under ``guided_choice`` over the same
labels is the most probable one. Labels: ``Yes``/``No`` (predicate), letters (choice), digits
(score levels, lowest first).
"""

from __future__ import annotations

import asyncio
import math
import string
from dataclasses import dataclass

from gateway.errors import InvalidRequest
from gateway.generate import core
from gateway.generate.events import Usage
from gateway.generate.request import CoreRequest
from gateway.generate.served_model import ServedModel
from gateway.policy.caller import Caller
from gateway.schemas.chat import SamplingOptions
from gateway.schemas.decisions import DecisionQuestion

MAX_QUESTIONS = 200
LETTERS = string.ascii_uppercase + string.ascii_lowercase
SYSTEM = "Read the input, then answer the question about it with one label from the options, and nothing else."


@dataclass(slots=True)
class Asked:
    """One question as the model sees it: its labels (one token each) and the values they stand for."""

    question: DecisionQuestion
    labels: list[str]
    values: list[object]
    lines: list[str]


def asked(question: DecisionQuestion, index: int) -> Asked:
    """The question's labels and option lines, or a 400 naming what is wrong with it."""
    param = f"questions[{index}]"
    if question.type == "predicate":
        return Asked(question, ["Yes", "No"], [True, False], ["Yes: the statement is true", "No: it is not"])
    if question.type == "choice":
        options = question.choices or []
        if not 2 <= len(options) <= len(LETTERS):
            raise InvalidRequest(f"`{param}.choices` must hold 2 to {len(LETTERS)} options", param=f"{param}.choices")
        values = [o.value for o in options]
        if len({(type(v), v) for v in values}) != len(values):
            raise InvalidRequest(f"`{param}.choices` holds the same value twice", param=f"{param}.choices")
        lines = [
            f"{LETTERS[i]}: {_described(str(o.value).lower() if isinstance(o.value, bool) else o.value, o.description)}"
            for i, o in enumerate(options)
        ]
        return Asked(question, list(LETTERS[: len(options)]), values, lines)
    if question.type == "score":
        levels = question.levels or []
        if not 2 <= len(levels) <= 10:
            raise InvalidRequest(f"`{param}.levels` must hold 2 to 10 levels", param=f"{param}.levels")
        lines = [f"{i}: {_described(level.label, level.description)}" for i, level in enumerate(levels)]
        return Asked(question, [str(i) for i in range(len(levels))], list(range(len(levels))), lines)
    raise InvalidRequest(
        f"`{param}.type` must be predicate, choice or score; got {question.type!r}", param=f"{param}.type"
    )


def _described(label: object, description: str | None) -> str:
    return f"{label} ({description})" if description else str(label)


def messages(text: str, item: Asked) -> list[dict]:
    """The chat of one question: the input first (the prefix every question shares), then the question."""
    kind = {"predicate": "Is the statement true?", "choice": "Which option fits?", "score": "Which level fits?"}
    question = item.question
    body = f"{text}\n\n---\n{kind[question.type]} {question.instructions}\nOptions:\n" + "\n".join(item.lines)
    body += f"\nAnswer with one of: {', '.join(item.labels)}."
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}]


def label_tokens(served: ServedModel, item: Asked, index: int) -> list[int]:
    """Each label's first token; they must differ, or the labels cannot be told apart."""
    tokens = [served.tokenizer.encode(label, add_special_tokens=False)[0] for label in item.labels]
    if len(set(tokens)) != len(tokens):
        raise InvalidRequest(
            f"this model's tokenizer cannot tell the labels of `questions[{index}]` apart", param=f"questions[{index}]"
        )
    return tokens


async def _logprob(served: ServedModel, ids: list[int], token: int, caller: Caller | None) -> tuple[float, Usage]:
    """The raw log-probability of ``token`` after ``ids``, from one forced one-token request."""
    sampling = SamplingOptions(temperature=0.0, logit_bias={str(token): 100.0})
    generation = await core.start(
        served, CoreRequest(sampling=sampling, prompts=[ids], max_tokens=1, logprobs=0), caller
    )
    (choice,) = await generation.collect(caller)
    usage = choice.finish.usage if choice.finish is not None else Usage()
    chosen = [lp.logprob for t, lp in choice.logprobs if t == token]
    return (chosen[0] if chosen else -math.inf), usage


async def probabilities(
    served: ServedModel, prompts: list[list[int]], tokens: list[list[int]], caller: Caller | None
) -> tuple[list[list[float]], Usage]:
    """Each question's label probabilities (summing to 1), and the usage: each prompt counted once.
    The first label is read alone first, so its prompt's shared prefix is cached for all the rest."""
    first = await _logprob(served, prompts[0], tokens[0][0], caller)
    rest = [(q, t) for q in range(len(prompts)) for t in range(len(tokens[q])) if (q, t) != (0, 0)]
    found = await asyncio.gather(*(_logprob(served, prompts[q], tokens[q][t], caller) for q, t in rest))
    read = {(0, 0): first, **dict(zip(rest, found))}
    result, usage = [], Usage()
    for q, labels in enumerate(tokens):
        logprobs = [read[q, t][0] for t in range(len(labels))]
        top = max(logprobs)
        weights = [math.exp(lp - top) if top > -math.inf else 1.0 for lp in logprobs]
        result.append([w / sum(weights) for w in weights])
        counted = read[q, 0][1]
        usage.prompt_tokens += counted.prompt_tokens
        usage.cached_tokens += counted.cached_tokens
    return result, usage
