"""Pieces the OpenAI routes share: model check, usage block, JSON responses."""

from __future__ import annotations

import orjson
from litestar import Response

from gateway.errors import NotFound
from gateway.generation import TextDelta


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise NotFound(f"the model `{requested}` does not exist; this server serves `{served}`", param="model", code="model_not_found")


def usage(delta: TextDelta) -> dict:
    return {
        "prompt_tokens": delta.prompt_tokens,
        "completion_tokens": delta.completion_tokens,
        "total_tokens": delta.prompt_tokens + delta.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": delta.cached_tokens},
    }


def json_response(payload: dict, request_id: str | None = None) -> Response:
    """A JSON response, with the request's id as X-Request-Id when there is one."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return Response(content=orjson.dumps(payload), media_type="application/json", headers=headers)
