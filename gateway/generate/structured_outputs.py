"""vLLM's guided-decoding fields on chat and completions: ``structured_outputs`` (vLLM >= 0.12:
``json``, ``json_object``, ``regex``, ``choice``, ``grammar``) and the older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, as the core's output format (the grammar
the worker enforces, gateway/generate/validation.py ``format_guide``). At most one may be given, and not
beside a ``response_format`` that asks for JSON."""

from __future__ import annotations

import json

from gateway.errors import InvalidRequest
from gateway.schemas.chat import SamplingFields

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def format_param(data: SamplingFields) -> str:
    """The field the request's output format came from, for its errors."""
    given = _given(data)
    return given[0][0] if given else "response_format"


def output_format(data: SamplingFields) -> dict | None:
    """The request's output format in the core's flat shape, from whichever field gave it."""
    given = _given(data)
    fmt = openai_format(data.response_format)
    asked = fmt is not None and fmt.get("type") != "text"
    if len(given) + asked > 1:
        names = [name for name, _, _ in given] + (["response_format"] if asked else [])
        raise InvalidRequest(f"give one output constraint, not {' and '.join(f'`{n}`' for n in names)}", param=names[1])
    if not given:
        return fmt
    param, kind, value = given[0]
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) and _is_json(value) else value
        if not isinstance(schema, dict):
            raise InvalidRequest(f"`{param}` must be a JSON Schema object (or its JSON text)", param=param)
        return {"type": "json_schema", "schema": schema}
    if kind == "json_object":
        return {"type": "json_object"} if value else fmt
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"`{param}` must be a non-empty list of non-empty strings", param=param)
        return {"type": "grammar", "spec": "start: " + " | ".join(json.dumps(c) for c in value)}  # Lark literals
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"`{param}` must be a non-empty string", param=param)
    return {"type": kind, "spec": value}


def _given(data: SamplingFields) -> list[tuple[str, str, object]]:
    """(field, kind, value) of every guided field the request set."""
    found = [(f"guided_{k}", k, getattr(data, f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")]
    nested = data.structured_outputs or {}
    if not isinstance(nested, dict):
        raise InvalidRequest(
            "`structured_outputs` must be an object (json, json_object, regex, choice or grammar)",
            param="structured_outputs",
        )
    found += [(f"structured_outputs.{k}", k, nested.get(k)) for k in _KINDS]
    return [item for item in found if item[2] is not None and item[2] is not False]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def openai_format(response_format: dict | None) -> dict | None:
    """OpenAI's ``response_format`` (chat, completions), whose json_schema nests the schema and
    ``strict`` under ``json_schema``, in the core's flat shape."""
    if response_format is None or response_format.get("type") != "json_schema":
        return response_format
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest(
            "`response_format.json_schema.schema` must be a JSON Schema object", param="response_format"
        )
    return {**spec, "type": "json_schema"}
