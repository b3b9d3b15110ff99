"""Derender's reading of a chat answer: given the ``chat_request`` that the token ids answer, a
reasoning model's thinking and the tool calls are read from the decoded text by the same parsers
chat runs on a live answer (gateway/generate/core.py ``parsed``), so derender's message equals the
chat completion's, ``reasoning_content`` and ``tool_calls`` included."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from gateway.errors import InvalidRequest
from gateway.generate import core
from gateway.generate.events import Choice
from gateway.generate.served_model import ServedModel, TextDelta
from gateway.generate.validation import prepare
from gateway.http.routes import chat
from gateway.schemas.chat import ChatCompletionRequest

Reader = Callable[[int, str, str | None], tuple[dict, str | None]]


async def chat_reader(served: ServedModel, chat_request: dict | None) -> Reader | None:
    """What turns choice ``index``'s text and finish reason into chat's message and finish reason
    (None: no ``chat_request``, the text is the content)."""
    if chat_request is None:
        return None
    try:
        body = msgspec.convert({"model": served.served_name, **chat_request}, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"`chat_request`: {exc}", param="chat_request") from None
    prepared = await prepare(served, chat.core_request(body), None)

    def read(index: int, text: str, finish: str | None) -> tuple[dict, str | None]:
        parser = prepared.parsers[index] if index < len(prepared.parsers) else None
        thinker = prepared.thinkers[index] if index < len(prepared.thinkers) else None
        choice = Choice(index)
        for event in core.parsed(index, TextDelta(text, finish or "stop", 0, 0), parser, thinker):
            core.gather(choice, event)
        message: dict = {"role": "assistant", "content": choice.content}
        if choice.reasoning:
            message["reasoning_content"] = message["reasoning"] = choice.reasoning
        if choice.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in choice.tool_calls
            ]
            finish = "tool_calls" if finish == "stop" and prepared.tools.mode != "named" else finish
        return message, finish

    return read
