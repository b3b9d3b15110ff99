"""Hostile and careless inputs against the real server: every one is a 400 naming its field, none
reaches a worker or costs the gateway more than a moment, and none slows other requests down."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest

from tests.conftest import MODEL, start_serve
from tests.gateway.test_templates import HOSTILE

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]


def schema(depth: int) -> dict:
    value: dict = {"type": "string"}
    for _ in range(depth):
        value = {"type": "object", "properties": {"a": value}}
    return value


BAD = [  # (path, body, the field the 400 names)
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [49152]}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [2**63]}, "stop_token_ids"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [True]}, "stop_token_ids[0]"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {str(2**63): 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"1" * 5000: 1}}, "logit_bias"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "logit_bias": {"²": 1}}, "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": [2**63], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 49152]], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [True, False], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [[True]], "max_tokens": 2}, "prompt"),
    ("/detokenize", {"tokens": [2**63]}, "tokens"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice"),
    (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": ["f"]}},
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": "x"}]}]},
        "messages[1].tool_calls[0].function",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(300)}}},
        "response_format",
    ),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema(300)}}]}, "tools"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ 1/0 }}"}, "chat_template"),  # not allowed on this server
    ("/tokenize", {"messages": CHAT["messages"], "chat_template": "{{ 1/0 }}"}, "chat_template"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p} {param}" for p, _, param in BAD])
def test_bad_fields_are_400s_naming_the_field(server, path, body, param):
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_chat_template_kwargs_named_like_python_arguments_render(server):
    for path, body in (("/v1/chat/completions", {**CHAT, "max_tokens": 1}), ("/tokenize", {"messages": CHAT["messages"]})):
        response = server.post(path, json={**body, "chat_template_kwargs": {"self": 1}})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"])
def test_json_nested_ten_thousand_deep_is_a_400_even_in_an_ignored_field(server, path):
    body = '{"model": "%s", "ignored": %s%s}' % (MODEL, "[" * 10_000, "]" * 10_000)
    response = server.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "levels deep" in error["message"] and error.get("param", "ignored") == "ignored"  # Anthropic's shape has no param


def test_huge_prompts_are_refused_before_tokenizing(server):
    cases = [
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hello " * 524_288}]}, "messages"),  # 3 MiB
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 100_000}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello " * 524_288}, "prompt"),
        ("/tokenize", {"prompt": "hello " * 524_288}, "prompt"),
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello " * 524_288}]}, None),
    ]
    for path, body, param in cases:
        started = time.monotonic()
        response = server.post(path, json=body)
        assert response.status_code == 400, response.text
        assert time.monotonic() - started < 2.0, path  # 4.5 s (3 MiB) and 5.3 s (100k messages) when tokenized first
        if param:
            assert response.json()["error"]["param"] == param and response.json()["error"]["code"] == "context_length_exceeded"


def test_big_tokenizing_jobs_do_not_hold_up_small_ones(server):
    """Inputs near the bound tokenize in their own lane: a dozen in flight (about 0.12 s each), a
    small request still gets its tokens at once (sharing two threads, it waited for ~0.7 s)."""
    letters = random.Random(1)  # varied text: repeated words tokenize from a cache, too fast to matter
    big = {"prompt": "".join(letters.choice("abcdefghijklmnopqrstuvwxyz     ,.") for _ in range(130_000))}  # just under 8192 x 16
    done: list[float] = []

    def send_big() -> None:
        with httpx.Client(timeout=120) as http:
            assert http.post(server.base_url + "/tokenize", json=big).status_code == 200
        done.append(time.monotonic())

    threads = [threading.Thread(target=send_big) for _ in range(12)]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    started = time.monotonic()
    small = server.post("/tokenize", json={"prompt": "hi"})
    small_s = time.monotonic() - started
    for thread in threads:
        thread.join()
    assert small.status_code == 200
    assert small_s < 0.3 and small_s < (max(done) - started) / 2, (small_s, [d - started for d in done])


def test_tokenize_counts_what_chat_sends(server):
    """/tokenize renders tools as chat does, so its count is chat's prompt_tokens."""
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}):
        chat = server.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, **extra}).json()
        count = server.post("/tokenize", json={"messages": CHAT["messages"], **extra}).json()["count"]
        assert count == chat["usage"]["prompt_tokens"], extra


@pytest.fixture(scope="module")
def templating():
    srv = start_serve("hardening-templates", 1, "--allow-request-chat-template")
    assert srv.post("/v1/chat/completions", json=CHAT).status_code == 200  # warm: a worker's first step compiles (seconds)
    yield srv
    srv.stop()


LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template", HOSTILE[:6])  # include, import, 1/0, a recursive macro, 2**100000, 'a' * 300000000
def test_a_hostile_request_template_is_a_400_naming_chat_template(templating, template):
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})):
        response = templating.post(path, json={**body, "chat_template": template})
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template", response.text


def test_looping_templates_end_at_their_deadline_and_hold_up_no_one(templating):
    results: list[httpx.Response] = []

    def send_loop() -> None:
        with httpx.Client(timeout=60) as http:
            results.append(http.post(templating.base_url + "/v1/chat/completions", json={**CHAT, "chat_template": LOOP}))

    threads = [threading.Thread(target=send_loop) for _ in range(2)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    small = templating.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    small_s = time.monotonic() - started
    for thread in threads:
        thread.join()
    assert small.status_code == 200 and small_s < 1.5, small_s
    assert [r.status_code for r in results] == [400, 400] and all(r.json()["error"]["param"] == "chat_template" for r in results)
    assert time.monotonic() - started < 8  # each stops after its 2 s budget (they take one lane, in turn)


def test_a_client_that_leaves_stops_its_template(templating):
    """The first request hangs up after 0.3 s: its render stops, so the next one (same lane) starts at once."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(templating.base_url + "/tokenize", json={"messages": CHAT["messages"], "chat_template": LOOP}, timeout=0.3)
    started = time.monotonic()
    response = templating.post("/tokenize", json={"messages": CHAT["messages"], "chat_template": LOOP})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    assert time.monotonic() - started < 2.9  # its own 2 s, not the first one's remaining 1.7 s too


def test_tokenize_honours_a_request_template(templating):
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    chat = templating.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "chat_template": template}).json()
    tokens = templating.post("/tokenize", json={"messages": CHAT["messages"], "chat_template": template}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"] == len(tokens["tokens"])
    assert templating.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "<hi>"
