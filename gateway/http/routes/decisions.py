"""POST /v1/decisions: OpenAI's Decisions API (predicate, choice and score questions over one input,
answered with probabilities) over gateway/generate/decisions.py."""

from __future__ import annotations

from litestar import Controller, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.errors import InvalidRequest
from gateway.generate import core
from gateway.generate import decisions as core_decisions
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.request import CoreRequest
from gateway.http.routes.common import documented, json_response
from gateway.policy.caller import Caller
from gateway.schemas.decisions import DecisionRequest


def input_text(given: str | list[dict]) -> str:
    """The input as one text: a string, or user messages whose content is text or input_text parts."""
    if isinstance(given, str):
        return given
    texts = []
    for i, message in enumerate(given):
        if not isinstance(message, dict) or message.get("role", "user") != "user":
            raise InvalidRequest(f"`input[{i}]` must be a user message", param=f"input[{i}]")
        content = message.get("content")
        parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
        for j, part in enumerate(parts if isinstance(parts, list) else [None]):
            if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"`input[{i}].content[{j}]` must be an input_text part (images are not supported here)",
                    param=f"input[{i}].content[{j}]",
                )
            texts.append(part["text"])
    if not texts:
        raise InvalidRequest("`input` must hold some text", param="input")
    return "\n\n".join(texts)


def _answer(item: core_decisions.Asked, probs: list[float]) -> dict:
    question = item.question
    if question.type == "predicate":
        return {"type": "predicate", "name": question.name, "probability": probs[0]}
    best = max(range(len(probs)), key=probs.__getitem__)
    if question.type == "choice":
        listed = [{"value": v, "probability": p} for v, p in zip(item.values, probs)]
        return {
            "type": "choice",
            "name": question.name,
            "choice": item.values[best],
            "confidence": probs[best],
            "probabilities": listed,
        }
    levels = question.levels or []
    listed = [{"value": i, "label": level.label, "probability": p} for i, (level, p) in enumerate(zip(levels, probs))]
    score = sum(i * p for i, p in enumerate(probs))
    return {"type": "score", "name": question.name, "score": score, "confidence": probs[best], "probabilities": listed}


class DecisionsController(Controller):
    path = "/v1/decisions"

    @post("/", status_code=200, responses=documented(None))
    async def create(
        self, data: JSONBody[DecisionRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
    ) -> Response:
        served = models.get(data.model)
        if not 1 <= len(data.questions) <= core_decisions.MAX_QUESTIONS:
            raise InvalidRequest(
                f"`questions` must hold 1 to {core_decisions.MAX_QUESTIONS} questions", param="questions"
            )
        text = input_text(data.input)
        items = [core_decisions.asked(q, i) for i, q in enumerate(data.questions)]
        tokens = [core_decisions.label_tokens(served, item, i) for i, item in enumerate(items)]
        prompts = []
        for item in items:
            req = CoreRequest(messages=core_decisions.messages(text, item), max_tokens=1, max_tokens_param="questions")
            prompts += await core.prompt_ids(served, req, caller)
        probs, usage = await core_decisions.probabilities(served, prompts, tokens, caller)
        body = {
            "model": served.served_name,
            "answers": [_answer(item, p) for item, p in zip(items, probs)],
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": 0,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens,
            },
        }
        return json_response(body)
