"""Inputs OpenAI's and Anthropic's APIs refuse are 400s here too, in each dialect's error shape and
naming the field (issue 25 found 15 that got a 200), and a forced tool call cut by max_tokens comes
back as the partial call it is, in every dialect, never as the grammar's ``[{"name": ...`` wrapper."""

from __future__ import annotations

import json

import pytest

from tests.conftest import MODEL

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": WEATHER}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER}
USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}


def responses(**fields) -> dict:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields}


def messages(*conversation: dict, **fields) -> dict:
    return {
        "model": MODEL,
        "max_tokens": 4,
        "messages": list(conversation) or [{"role": "user", "content": "hi"}],
        **fields,
    }


def user(content) -> dict:
    return {"role": "user", "content": content}


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}
BAD = [  # (path, body, the field the 400 names)
    # Responses
    (
        "/v1/responses",
        responses(input=[{"type": "function_call_output", "call_id": "call_9", "output": "sunny"}]),
        "input[0].call_id",
    ),
    (
        "/v1/responses",
        responses(input=[CALL, {"type": "function_call_output", "call_id": "call_9", "output": "x"}]),
        "input[1].call_id",
    ),
    ("/v1/responses", responses(input=[{**CALL, "arguments": "{city: Oslo"}]), "input[0].arguments"),
    ("/v1/responses", responses(input=[{**CALL, "call_id": None}]), "input[0].call_id"),
    (
        "/v1/responses",
        responses(
            tools=[{**RESPONSES_TOOL, "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}]
        ),
        "tools[0]",
    ),
    ("/v1/responses", responses(tools=[RESPONSES_TOOL, RESPONSES_TOOL], tool_choice="auto"), "tools[1].name"),
    ("/v1/responses", responses(max_output_tokens="5"), "max_output_tokens"),
    ("/v1/responses", responses(temperature="0.5"), "temperature"),
    ("/v1/responses", responses(input=[{"type": "message", "role": "user", "content": []}]), "input[0].content"),
    # Anthropic
    ("/v1/messages", messages(max_tokens="10"), "max_tokens"),
    (
        "/v1/messages",
        messages(user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}])),
        "messages[0].content[0].tool_use_id",
    ),
    (
        "/v1/messages",
        messages(user("hi"), {"role": "assistant", "content": [USE]}, user([{"type": "tool_result", "content": "x"}])),
        "messages[2].content[0].tool_use_id",
    ),
    ("/v1/messages", messages(system=[{"type": "image", "text": "x"}]), "system[0].type"),
    (
        "/v1/messages",
        messages(user("hi"), {"role": "assistant", "content": [{**USE, "id": None}]}, user("ok")),
        "messages[1].content[0].id",
    ),
    (
        "/v1/messages",
        messages(user("hi"), {"role": "assistant", "content": [{**USE, "name": None}]}, user("ok")),
        "messages[1].content[0].name",
    ),
    ("/v1/messages", messages(user([])), "messages[0].content"),
    ("/v1/messages", messages(user("")), "messages[0].content"),
    ("/v1/messages", messages(tools=[ANTHROPIC_TOOL, ANTHROPIC_TOOL]), "tools[1].name"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [user([])]}, "messages[0].content"),
    # Chat and completions refuse numbers as strings too
    ("/v1/chat/completions", {"model": MODEL, "messages": [user("hi")], "max_tokens": "5"}, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [user("hi")], "max_tokens": 2, "stream": "true"}, "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": "2"}, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [user([])], "max_tokens": 2}, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}], "max_tokens": 2}, "messages[0].content"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p} {param}" for p, _, param in BAD])
def test_bad_dialect_inputs_are_400s_in_the_dialects_shape(server, path, body, param):
    response = server.post(path, json=body)
    assert response.status_code == 400, response.text
    if path.startswith("/v1/messages"):
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert f"`{param}`" in error["error"]["message"], error
    else:
        assert response.json()["error"]["param"] == param, response.text


def test_the_good_neighbours_of_those_inputs_are_answered(server):
    """A result that answers a call made earlier (in the input, or the stored previous response) is fine."""
    good = [
        (
            "/v1/responses",
            responses(
                input=[user("Weather?"), CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
            ),
        ),
        (
            "/v1/messages",
            messages(
                user("hi"),
                {"role": "assistant", "content": [USE]},
                user([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]),
            ),
        ),
        (
            "/v1/messages",
            messages(user("hi"), {"role": "assistant", "content": ""}),
        ),  # an empty final assistant turn is a prefill
        ("/v1/messages", messages(system=[{"type": "text", "text": "Be brief."}], max_tokens=4)),
    ]
    for path, body in good:
        response = server.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
    first = server.post(
        "/v1/responses",
        json=responses(input="Weather in Oslo?", tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=40),
    )
    call = next(item for item in first.json()["output"] if item["type"] == "function_call")
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    follow = server.post(
        "/v1/responses", json=responses(input=[answer], previous_response_id=first.json()["id"], tools=[RESPONSES_TOOL])
    )
    assert follow.status_code == 200, follow.text


CUT = 14  # tokens: past `[{"name": "get_weather", "arguments": {"c` and short of the call's end


def test_a_required_call_cut_by_max_tokens_is_a_partial_call_in_chat(server):
    body = {"model": MODEL, "messages": [user("Weather in Reykjavik, Iceland?")], "max_tokens": CUT, "temperature": 0}
    body |= {
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        "tool_choice": "required",
    }
    choice = server.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"], choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith('{"c'), call
    with pytest.raises(json.JSONDecodeError):
        json.loads(call["function"]["arguments"])  # cut: partial JSON, as a named call cut short gives


def test_a_required_call_cut_by_max_tokens_is_an_incomplete_response(server):
    body = responses(
        input="Weather in Reykjavik, Iceland?",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        max_output_tokens=CUT,
        temperature=0,
    )
    answer = server.post("/v1/responses", json=body).json()
    assert answer["status"] == "incomplete" and answer["incomplete_details"]["reason"] == "max_output_tokens", answer
    assert [item["type"] for item in answer["output"]] == ["function_call"], answer["output"]
    assert answer["output"][0]["name"] == "get_weather" and answer["output"][0]["arguments"].startswith('{"c'), answer[
        "output"
    ]


def test_a_forced_tool_use_cut_by_max_tokens_stops_for_max_tokens(server):
    body = messages(
        user("Weather in Reykjavik, Iceland?"),
        tools=[ANTHROPIC_TOOL],
        tool_choice={"type": "any"},
        max_tokens=CUT,
        temperature=0,
    )
    answer = server.post("/v1/messages", json=body).json()
    assert answer["stop_reason"] == "max_tokens", answer
    assert [block["type"] for block in answer["content"]] == ["tool_use"] and answer["content"][0][
        "name"
    ] == "get_weather", answer
