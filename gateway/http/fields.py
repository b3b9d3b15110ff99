"""Fields a request body carries that no API defines (its dialect's Struct does not name them): each
is logged once per name and counted in ``llmpool_unknown_fields_total``, as vLLM logs the fields it
ignores, so a client's typo is seen; under ``--strict-fields`` it is refused with a 400 that names it,
in the dialect's shape. Fields the APIs define but this server ignores are named in the Structs and
listed in docs/api/fields.md."""

from __future__ import annotations

import logging
from functools import lru_cache

import msgspec
from prometheus_client import Counter

from gateway.errors import InvalidRequest

log = logging.getLogger(__name__)
MAX_NAMES = 256  # names logged and counted by name; the rest count as "other"


@lru_cache(maxsize=256)
def known_fields(model: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(model))


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
        for name in value:
            if name in known:
                continue
            if self.strict:
                raise InvalidRequest(
                    f"unknown field `{name[:64]}`: no API defines it here (this server runs with --strict-fields)",
                    param=name,
                    code="unknown_field",
                )
            first = name not in self.seen and len(self.seen) < MAX_NAMES
            if first:
                self.seen.add(name)
            if self.counter is not None:  # a bounded set of label values: the first names seen, then "other"
                self.counter.labels(field=name if name in self.seen else "other").inc()
            if first:
                log.warning("ignoring the unknown field %r (first seen on %s); --strict-fields refuses it", name, path)
