"""Checks the Responses and Messages dialects make while they translate a conversation into chat
messages, so that what OpenAI and Anthropic refuse is a 400 naming the field here too, rather than
a prompt the model reads some odd way (a tool result answering no call, an empty message dropped)."""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from gateway.errors import InvalidRequest


class ToolCallLedger:
    """The ids of the tool calls a conversation has made so far: a result must answer one of them."""

    def __init__(self, history: Iterable[dict] = ()) -> None:
        self.ids = {
            call.get("id") for message in history for call in message.get("tool_calls") or [] if isinstance(call, dict)
        }

    def call(self, call_id: str | None, param: str) -> None:
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest(f"`{param}` is required: a tool call needs its id", param=param)
        self.ids.add(call_id)

    def result(self, call_id: str | None, param: str, call_kind: str) -> None:
        if not isinstance(call_id, str) or not call_id:
            raise InvalidRequest(f"`{param}` is required: a tool result names the call it answers", param=param)
        if call_id not in self.ids:
            raise InvalidRequest(
                f"`{param}` {call_id!r} answers no earlier {call_kind} in the conversation", param=param
            )


def required_text(value: object, param: str) -> str:
    """A field that must be a non-empty string (a tool call's name)."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"`{param}` is required and must be a non-empty string", param=param)
    return value


def json_arguments(arguments: str | None, param: str) -> str:
    """A function call's arguments: JSON text (an empty value means no arguments)."""
    if not arguments:
        return "{}"
    try:
        orjson.loads(arguments)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"`{param}` must be JSON text: {exc}", param=param) from None
    return arguments


def not_empty(content: object, param: str) -> None:
    """A message must say something: ``""`` or ``[]`` is a 400 (it was silently dropped, and the
    model answered a conversation without it)."""
    if content is None or content == "" or content == []:
        raise InvalidRequest(f"`{param}` is empty: a message needs content", param=param)
