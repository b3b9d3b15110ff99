"""Hostile and careless inputs against the real server: every one is a 400 naming its field, none
reaches a worker or costs the gateway more than a moment, and none slows other requests down."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, wait_until
from tests.gateway.test_templates import HOSTILE

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}},
    }
]


def lane_jobs(server, lane: str) -> Counter[str]:
    """The gateway's tokenize and template jobs in ``lane`` (gateway/ops/metrics.py): ``in_flight``
    (queued or running), and those ended by outcome (``done``, ``error``, ``deadline``, ``cancelled``)."""
    jobs: Counter[str] = Counter()
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for s in family.samples:
            if s.labels.get("lane") == lane and s.name == "llmpool_gateway_tokenize_jobs":
                jobs["in_flight"] = s.value
            elif s.labels.get("lane") == lane and s.name == "llmpool_gateway_tokenize_jobs_ended_total":
                jobs[s.labels["outcome"]] = s.value
    return jobs


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
    (
        "/v1/chat/completions",
        {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": "f"}},
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
        "tool_choice",
    ),
    (
        "/v1/responses",
        {
            "model": MODEL,
            "input": "hi",
            "tools": [{"type": "function", "name": "f"}],
            "tool_choice": {"type": "function", "name": ["f"]},
        },
        "tool_choice",
    ),
    (
        "/v1/chat/completions",
        {
            **CHAT,
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": "x"}]}],
        },
        "messages[1].tool_calls[0].function",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema(300)}}},
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": schema(300)}}]},
        "tools",
    ),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ 1/0 }}"}, "chat_template"),  # not allowed on this server
    ("/tokenize", {"messages": CHAT["messages"], "chat_template": "{{ 1/0 }}"}, "chat_template"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p} {param}" for p, _, param in BAD])
def test_bad_fields_are_400s_naming_the_field(server, path, body, param):
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_chat_template_kwargs_named_like_python_arguments_render(server):
    for path, body in (
        ("/v1/chat/completions", {**CHAT, "max_tokens": 1}),
        ("/tokenize", {"messages": CHAT["messages"]}),
    ):
        response = server.post(path, json={**body, "chat_template_kwargs": {"self": 1}})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/tokenize"]
)
def test_json_nested_ten_thousand_deep_is_a_400_even_in_an_ignored_field(server, path):
    body = '{"model": "%s", "ignored": %s%s}' % (MODEL, "[" * 10_000, "]" * 10_000)
    response = server.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (
        "levels deep" in error["message"] and error.get("param", "ignored") == "ignored"
    )  # Anthropic's shape has no param


def test_huge_prompts_are_refused_before_tokenizing(server):
    cases = [
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "hello " * 524_288}]},
            "messages",
        ),  # 3 MiB
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi"}] * 100_000}, "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": "hello " * 524_288}, "prompt"),
        ("/tokenize", {"prompt": "hello " * 524_288}, "prompt"),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hello " * 524_288}]},
            None,
        ),
    ]
    before = {lane: lane_jobs(server, lane) for lane in ("small", "big")}
    for path, body, param in cases:
        response = server.post(path, json=body)
        assert response.status_code == 400, response.text
        # Tokenized first, it took 4.5 s (3 MiB) and 5.3 s (100k messages): no job reached a lane.
        assert {lane: lane_jobs(server, lane) for lane in ("small", "big")} == before, path
        if param:
            assert (
                response.json()["error"]["param"] == param
                and response.json()["error"]["code"] == "context_length_exceeded"
            )


def test_big_tokenizing_jobs_do_not_hold_up_small_ones(server):
    """Inputs near the bound tokenize in their own lane: with a dozen queued there (about 0.12 s
    each), a small request still gets its tokens at once, before most of them end (sharing two
    threads, it waited for ~0.7 s, behind every one queued before it)."""
    letters = random.Random(1)  # varied text: repeated words tokenize from a cache, too fast to matter
    big = {
        "prompt": "".join(letters.choice("abcdefghijklmnopqrstuvwxyz     ,.") for _ in range(130_000))
    }  # just under 8192 x 16
    done: list[float] = []

    def send_big() -> None:
        with httpx.Client(timeout=120) as http:
            assert http.post(server.base_url + "/tokenize", json=big).status_code == 200
        done.append(time.monotonic())

    before = lane_jobs(server, "big")
    threads = [threading.Thread(target=send_big) for _ in range(12)]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: lane_jobs(server, "big").total() - before.total() >= 12,
        60,
        "the 12 big jobs in their lane",
        interval=0.01,
    )
    queued = lane_jobs(server, "big")["in_flight"]
    small = server.post("/tokenize", json={"prompt": "hi"})
    answered = time.monotonic()
    for thread in threads:
        thread.join()
    assert small.status_code == 200 and queued >= 4, queued
    # Behind them, it would end after all of them; in its own lane, before most of them.
    assert sum(d > answered for d in done) >= queued / 2, (queued, [round(d - answered, 2) for d in done])


def test_tokenize_counts_what_chat_sends(server):
    """/tokenize renders tools as chat does, so its count is chat's prompt_tokens."""
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "none"}):
        chat = server.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, **extra}).json()
        count = server.post("/tokenize", json={"messages": CHAT["messages"], **extra}).json()["count"]
        assert count == chat["usage"]["prompt_tokens"], extra


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
            results.append(
                http.post(templating.base_url + "/v1/chat/completions", json={**CHAT, "chat_template": LOOP})
            )

    before = lane_jobs(templating, "big")
    threads = [threading.Thread(target=send_loop) for _ in range(2)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    wait_until(
        lambda: lane_jobs(templating, "big")["in_flight"] == 2, 30, "both loops in their lane"
    )  # one runs, one waits
    small = templating.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    loops_ended_first = len(results)
    for thread in threads:
        thread.join()
    assert small.status_code == 200 and loops_ended_first == 0, "the small request waited for a loop"
    assert [r.status_code for r in results] == [400, 400] and all(
        r.json()["error"]["param"] == "chat_template" for r in results
    )
    assert lane_jobs(templating, "big")["deadline"] == before["deadline"] + 2
    assert time.monotonic() - started < 8  # each stops after its 2 s budget (they take one lane, in turn: 4 s)


def test_a_client_that_leaves_stops_its_template(templating):
    """The first request hangs up after 0.3 s: its render stops then, not at its 2 s deadline, and
    the next one (same lane) runs to its own deadline."""
    before = lane_jobs(templating, "big")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            templating.base_url + "/tokenize", json={"messages": CHAT["messages"], "chat_template": LOOP}, timeout=0.3
        )
    wait_until(lambda: lane_jobs(templating, "big")["in_flight"] == 0, 30, "the render to stop")
    stopped = lane_jobs(templating, "big")
    assert (stopped["cancelled"], stopped["deadline"]) == (before["cancelled"] + 1, before["deadline"]), stopped
    response = templating.post("/tokenize", json={"messages": CHAT["messages"], "chat_template": LOOP})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template"
    assert lane_jobs(templating, "big")["deadline"] == before["deadline"] + 1


def test_tokenize_honours_a_request_template(templating):
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    chat = templating.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1, "chat_template": template}).json()
    tokens = templating.post("/tokenize", json={"messages": CHAT["messages"], "chat_template": template}).json()
    assert tokens["count"] == chat["usage"]["prompt_tokens"] == len(tokens["tokens"])
    assert templating.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "<hi>"
