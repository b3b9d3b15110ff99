"""Fields a request body carries that no API defines (its dialect's Struct does not name them): each
is logged once per name and counted in ``llmpool_unknown_fields_total``, as vLLM logs the fields it
ignores, so a client's typo is seen; under ``--strict-fields`` it is refused with a 400 that names it,
in the dialect's shape. Fields the APIs define but this server ignores are named in the Structs and
listed in docs/api/fields.md.

Nested objects are checked where clients put their own settings (``NESTED``): ``reasoning``,
``text`` and its ``format``, tool definitions, and message content parts (not the messages
themselves: SDKs replay an answer's message with fields such as ``refusal`` or ``annotations``).
A nested name is logged and counted by its dotted path (``tools.function.strictt``), and a strict
refusal names it with its indices (``tools[0].function.strictt``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import lru_cache

import msgspec
import msgspec.inspect as mi
from prometheus_client import Counter

from gateway.errors import InvalidRequest

log = logging.getLogger(__name__)
MAX_NAMES = 256  # names logged and counted by name; the rest count as "other"

# Where nested objects are checked: name -> (check this object's names, what to descend into).
Spec = dict[str, tuple[bool, "Spec"]]
NESTED: Spec = {
    "reasoning": (True, {}),
    "text": (True, {"format": (True, {})}),
    "tools": (True, {"function": (True, {})}),
    "messages": (False, {"content": (True, {})}),
    "input": (False, {"content": (True, {})}),
    "system": (True, {}),
}
# Names an API defines for an object typed here as a plain dict, or beyond its Struct's fields.
DICT_NAMES = {
    "reasoning": {"effort", "max_tokens", "exclude", "enabled", "summary", "generate_summary"},
    "tools": {"type", "function", "custom", "cache_control"},
    "tools.function": {"name", "description", "parameters", "strict"},
    "messages.content": {"signature", "citations", "data", "input_audio", "file", "refusal"},  # replayed parts
}


@lru_cache(maxsize=256)
def known_fields(model: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(model))


@lru_cache(maxsize=256)
def field_structs(model: type[msgspec.Struct]) -> dict[str, type[msgspec.Struct] | None]:
    """Each field's Struct, where its type holds one (in a list, a union, an optional)."""
    return {f.encode_name: _struct_in(f.type) for f in mi.type_info(model).fields}  # type: ignore[union-attr]


def _struct_in(kind: mi.Type) -> type[msgspec.Struct] | None:
    if isinstance(kind, mi.StructType):
        return kind.cls
    if isinstance(kind, (mi.ListType, mi.UnionType)):
        for inner in (kind.item_type,) if isinstance(kind, mi.ListType) else kind.types:
            found = _struct_in(inner)
            if found is not None:
                return found
    return None


def nested_unknown(
    value: dict, model: type[msgspec.Struct] | None, spec: Spec, path: str, name: str, check: bool
) -> Iterator[tuple[str, str]]:
    """(dotted name, param with indices) of each unknown name inside ``value`` where ``spec`` looks."""
    known = (known_fields(model) if model is not None else frozenset()) | DICT_NAMES.get(name, set())
    if check and (model is not None or name in DICT_NAMES):
        for key in value:
            if key not in known:
                yield f"{name}.{key}", f"{path}.{key}"
    structs = field_structs(model) if model is not None else {}
    for key, (inner_check, inner_spec) in spec.items():
        for index, item in _objects(value.get(key)):
            at = f"{path}.{key}" if index is None else f"{path}.{key}[{index}]"
            yield from nested_unknown(item, structs.get(key), inner_spec, at, f"{name}.{key}", inner_check)


def _objects(value: object) -> Iterator[tuple[int | None, dict]]:
    if isinstance(value, dict):
        yield None, value
    elif isinstance(value, list):
        yield from ((i, item) for i, item in enumerate(value) if isinstance(item, dict))


class FieldWatch:
    """What this gateway does with unknown fields: log them once per name, count them, refuse them if strict."""

    def __init__(self, strict: bool, counter: Counter | None) -> None:
        self.strict = strict
        self.counter = counter
        self.seen: set[str] = set()

    def check(self, value: object, model: type[msgspec.Struct], path: str) -> None:
        if not isinstance(value, dict):
            return
        known = known_fields(model)
        found = [(name, name) for name in value if name not in known]
        structs = field_structs(model)
        for key, (check, spec) in NESTED.items():
            for index, item in _objects(value.get(key) if key in known else None):
                at = key if index is None else f"{key}[{index}]"
                found += nested_unknown(item, structs.get(key), spec, at, key, check)
        for name, param in found:
            if self.strict:
                raise InvalidRequest(
                    f"unknown field `{param[:96]}`: no API defines it here (this server runs with --strict-fields)",
                    param=param,
                    code="unknown_field",
                )
            first = name not in self.seen and len(self.seen) < MAX_NAMES
            if first:
                self.seen.add(name)
            if self.counter is not None:  # a bounded set of label values: the first names seen, then "other"
                self.counter.labels(field=name if name in self.seen else "other").inc()
            if first:
                log.warning("ignoring the unknown field %r (first seen on %s); --strict-fields refuses it", name, path)
