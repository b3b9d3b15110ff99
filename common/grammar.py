"""A ``Guide`` (the wire form of guided decoding) as an llguidance grammar: the worker compiles it,
the gateway checks it first so that a bad schema is a 400 before any response starts (streams too)."""

from __future__ import annotations

import json
import re

from common.protocol import Guide, GuideKind

_GBNF = re.compile(r"^\s*root\s*::=", re.MULTILINE)
# JSON in the usual compact-but-readable style; free whitespace lets small models loop on newlines.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A guide that does not make a valid grammar."""


def grammar_text(guide: Guide) -> str:
    """The llguidance grammar for ``guide``; raises GrammarError for an unknown kind or bad JSON."""
    import llguidance  # imported on first use: the gateway may never need it

    try:
        if guide.kind == GuideKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_STYLE)  # type: ignore[arg-type]
        if guide.kind == GuideKind.JSON_SCHEMA:
            return llguidance.LLMatcher.grammar_from_json_schema(json.loads(guide.spec), defaults=_JSON_STYLE)  # type: ignore[arg-type]
        if guide.kind == GuideKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(guide.spec)
        if guide.kind == GuideKind.GRAMMAR:  # GBNF (llama.cpp's, xgrammar's: its start rule is root) or Lark
            return llguidance.grammar_from("ebnf" if _GBNF.search(guide.spec) else "lark", guide.spec)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the {_named(guide)} is invalid: {exc}") from None
    raise GrammarError(f"unknown grammar kind {guide.kind!r}")


def _named(guide: Guide) -> str:
    return "grammar" if guide.kind == GuideKind.GRAMMAR else f"{guide.kind} grammar"


def check_guide(guide: Guide) -> None:
    """Raise GrammarError unless the guide compiles (about 0.2 ms for a small schema)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_text(guide))
    if error:
        raise GrammarError(f"the {_named(guide)} is invalid: {error}")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: object) -> object:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists its
    ``properties`` and does not say otherwise, as OpenAI's strict mode and xgrammar read function
    parameters. JSON Schema's own default
    (anything more is allowed) lets a small model add invented fields until ``max_tokens`` cuts
    the object off; closed, it has nothing to write after the known fields but ``}``."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    for key in ("items", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    if isinstance(out.get("additionalProperties"), dict):
        out["additionalProperties"] = closed_objects(out["additionalProperties"])
    # An object that lists its properties is closed; a bare {"type": "object"} stays free-form.
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out
