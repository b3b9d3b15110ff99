"""Fields clients send: the accepted ones (service_tier echoed, OpenRouter's reasoning), and the
unknown ones, logged once and counted, or refused in the dialect's shape under --strict-fields; in
process over the fake fleet (tests/gateway/conftest.py)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from gateway.http.fields import FieldWatch

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
CLIENT_FIELDS = {
    "service_tier": "flex",
    "safety_identifier": "user-1",
    "prompt_cache_key": "k",
    "prompt_cache_retention": "24h",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "x"},
    "provider": {"order": ["a"]},
    "reasoning": {"exclude": True, "effort": "low"},
    "store": False,
    "metadata": {"a": "b"},
}


def watch(strict: bool) -> tuple[FieldWatch, Counter]:
    counter = Counter("llmpool_unknown_fields", "test", ["field"], registry=CollectorRegistry())
    return FieldWatch(strict, counter), counter


def test_client_fields_are_accepted_and_service_tier_is_echoed(inproc):
    inproc.app.state.fields, _ = watch(strict=True)  # every field below is one an API defines
    try:
        answer = inproc.post("/v1/chat/completions", json={**CHAT, **CLIENT_FIELDS})
        assert answer.status_code == 200, answer.text
        assert answer.json()["service_tier"] == "flex"
        plain = inproc.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert '"service_tier":"default"' in plain.text
        tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}
        body = {
            "model": "m",
            "input": "Hi",
            "store": False,
            "max_output_tokens": 2,
            "service_tier": "auto",
            "text": {"verbosity": "low"},
            "reasoning": {"summary": "auto", "exclude": True},
            "include": ["reasoning.encrypted_content"],
            "safety_identifier": "u",
            "tools": [tool],
        }
        response = inproc.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["service_tier"] == "default" and response.json()["tools"][0]["strict"] is True
        messages = {
            "model": "m",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "Hi"}],
            "service_tier": "auto",
        }
        assert inproc.post("/v1/messages", json=messages).status_code == 200
    finally:
        inproc.app.state.fields = None


def test_unknown_fields_are_logged_once_and_counted_or_refused_when_strict(inproc, caplog):
    inproc.app.state.fields, counter = watch(strict=False)
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.http.fields"):
            for _ in range(2):
                assert inproc.post("/v1/chat/completions", json={**CHAT, "zzz_not_a_field": 1}).status_code == 200
        assert sum("zzz_not_a_field" in r.message for r in caplog.records) == 1
        assert counter.labels(field="zzz_not_a_field")._value.get() == 2

        inproc.app.state.fields, _ = watch(strict=True)
        refused = inproc.post("/v1/chat/completions", json={**CHAT, "zzz_not_a_field": 1})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "zzz_not_a_field"
        messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}], "temprature": 0}
        refused = inproc.post("/v1/messages", json=messages)
        assert refused.status_code == 400 and refused.json()["type"] == "error"
        assert "temprature" in refused.json()["error"]["message"]
    finally:
        inproc.app.state.fields = None


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
PARTS = [{"type": "text", "text": "Hi"}]


def test_nested_unknown_fields_are_named_by_their_path(inproc, caplog):
    inproc.app.state.fields, counter = watch(strict=False)
    try:
        body = {**CHAT, "reasoning": {"efort": "low"}, "messages": [{"role": "user", "content": PARTS}]}
        with caplog.at_level(logging.WARNING, logger="gateway.http.fields"):
            for _ in range(2):
                assert inproc.post("/v1/chat/completions", json=body).status_code == 200
        assert sum("reasoning.efort" in r.message for r in caplog.records) == 1
        assert counter.labels(field="reasoning.efort")._value.get() == 2

        inproc.app.state.fields, _ = watch(strict=True)
        legit = {**CHAT, "tools": [TOOL], "messages": [{"role": "user", "content": PARTS, "refusal": None}]}
        assert inproc.post("/v1/chat/completions", json=legit).status_code == 200  # message-level names pass
        cases = [
            ("/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "function": {"name": "f", "strictt": True}}]}),
            ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{**PARTS[0], "txet": 1}]}]}),
            ("/v1/responses", {"model": "m", "input": "Hi", "text": {"format": {"type": "text", "shema": {}}}}),
        ]
        params = []
        for path, bad in cases:
            refused = inproc.post(path, json=bad)
            assert refused.status_code == 400, refused.text
            params.append(refused.json()["error"]["param"])
        assert params == ["tools[0].function.strictt", "messages[0].content[0].txet", "text.format.shema"]
        anthropic = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": [{**PARTS[0], "x": 1}]}]}
        refused = inproc.post("/v1/messages", json=anthropic)
        assert refused.status_code == 400 and "messages[0].content[0].x" in refused.json()["error"]["message"]
    finally:
        inproc.app.state.fields = None
