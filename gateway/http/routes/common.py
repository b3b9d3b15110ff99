"""Pieces every dialect's route shares: JSON and SSE responses; OpenAI's usage block and output format."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias, TypeVar

import msgspec
from litestar import Response
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from gateway.errors import not_stored
from gateway.generate.core import Generation
from gateway.generate.events import Choice, Usage
from gateway.http.streaming import SSE_HEADERS, sse_events
from gateway.policy.caller import Caller
from gateway.schemas.chat import CompletionTokensDetails, ErrorBody, PromptTokensDetails
from gateway.schemas.chat import Usage as OpenAIUsage
from gateway.state.service import StateService

_encoder = msgspec.json.Encoder()
T = TypeVar("T")
# The state store as a route takes it (Litestar's ``stored`` dependency, gateway/http/app.py).
StateStore: TypeAlias = NamedDependency[StateService]


def json_response(payload: Any, request_id: str | None = None) -> Response:
    """A JSON response (a dict or a Struct), with the request's id as X-Request-Id when there is one."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(content=_encoder.encode(payload), media_type="application/json", headers=headers)


def event_stream(chunks: AsyncIterator[Any], request_id: str, named: bool = False, stream_id: str = "") -> Stream:
    """An SSE response (see ``gateway.http.streaming`` for the two framings)."""
    return Stream(
        sse_events(chunks, named, stream_id),
        media_type="text/event-stream",
        headers={**SSE_HEADERS, "X-Request-Id": request_id},
    )


async def answer(
    caller: Caller,
    generation: Generation,
    stream: bool,
    events: Callable[[], AsyncIterator[Any]],
    body: Callable[[list[Choice]], Any],
    stream_id: str = "",
    named: bool = False,
) -> Response:
    """A dialect's answer: its ``events`` as a stream (each with an ``id:`` after ``stream_id``), or
    its ``body`` once every choice is whole (the generation is aborted if the client hangs up first)."""
    if stream:
        return event_stream(events(), generation.request_id, named, stream_id)
    return json_response(body(await generation.collect(caller)), generation.request_id)


ERROR_STATUSES = {
    400: "a bad request (the error names the field)",
    401: "a missing or wrong API key",
    404: "no such model or object",
    429: "overloaded: retry",
    499: "the client closed the connection",
    500: "a server error",
    503: "no worker is available",
    504: "the request timed out",
}


def documented(body: type | None, description: str = "", error: type = ErrorBody) -> dict[int, ResponseSpec]:
    """OpenAPI: the body a route answers with when not streaming (streams are text/event-stream),
    and its errors' body (OpenAI's shape, or Anthropic's under /v1/messages)."""
    responses = {
        status: ResponseSpec(data_container=error, description=what) for status, what in ERROR_STATUSES.items()
    }
    if body is not None:
        responses[200] = ResponseSpec(data_container=body, description=description)
    return responses


def openai_usage(usage: Usage) -> OpenAIUsage:
    return OpenAIUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(usage.reasoning_tokens)
        if usage.reasoning_tokens
        else msgspec.UNSET,
    )


class Stored:
    """One kind of stored object (conversation, file, batch, response) as its routes look it up:
    what a lookup found, or the 404 that names the id; another key's objects are as absent, so
    ids leak nothing across keys."""

    def __init__(self, what: str, param: str) -> None:
        self.what, self.param = what, param

    def found(self, value: T | None, ident: str) -> T:
        """``value`` (a lookup's result: None, or False from a delete, when there is none)."""
        if value is None or value is False:
            raise not_stored(self.what, ident, self.param)
        return value


CONVERSATION = Stored("conversation", "conversation_id")
FILE = Stored("file", "file_id")
BATCH = Stored("batch", "batch_id")
RESPONSE = Stored("response", "response_id")
