"""The body's nesting depth is found without decoding it, brackets inside strings not counted."""

import json

from gateway.http.request_body import MAX_JSON_DEPTH, deep_field, too_deep


def nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def test_depth_is_bounded_and_the_deep_field_named():
    assert not too_deep(json.dumps({"a": nested(MAX_JSON_DEPTH - 1)}).encode())
    body = json.dumps({"model": "m", "messages": [{"content": "["}], "zzz": nested(MAX_JSON_DEPTH)}).encode()
    assert too_deep(body) and deep_field(body) == "zzz"
    body = b'{"a": {"b": "}}}", "c": ' + b"[" * 10_000 + b"]" * 10_000 + b"}}"
    assert too_deep(body) and deep_field(body) == "a"


def test_brackets_inside_strings_do_not_count():
    body = json.dumps({"messages": [{"content": "[{" * 5000 + '\\"'}]}).encode()
    assert not too_deep(body)
