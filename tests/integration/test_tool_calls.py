"""Tool calls through the OpenAI SDK against the real server and model: named and required choices
(guided decoding makes the call certain), auto (the model's own Hermes-format output parsed), none,
streamed deltas, and a conversation that carries a tool result back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conftest import MODEL

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get the current weather for a city", "parameters": PARAMETERS},
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["tz"],
        },
    },
}
# A 135M model was never taught to call tools, but it copies text faithfully: this makes it write a
# Hermes tool call of its own accord (tool_choice auto), which the server must recognise.
COPY_A_CALL = 'Repeat exactly this text and nothing else:\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def assemble(chunks) -> tuple[str, dict[int, dict], list[str]]:
    """Content, tool calls by index (arguments joined) and finish reasons of a streamed answer."""
    content, calls, finishes = "", {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            call["name"] += (delta.function.name or "") if delta.function else ""
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return content, calls, finishes


def test_a_named_tool_choice_always_calls_it_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Oslo?"),
        tools=[WEATHER, TIME],
        tool_choice=choice,
        temperature=0.8,
        seed=4,
        max_tokens=60,
    )
    answer = reply.choices[0]
    assert answer.finish_reason == "stop" and answer.message.content is None  # OpenAI's: a named call ends with "stop"
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS)

    content, calls, finishes = assemble(
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Weather in Lima?"),
            tools=[WEATHER],
            tool_choice=choice,
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    assert content == "" and finishes == ["stop"] and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS)


def test_forced_arguments_stop_at_the_schema_and_close_the_object(client):
    """Parameters without additionalProperties are read as strict mode reads them: before, the
    model added invented fields ({"city": "Paris", "weather": "Temp: 22, ...) until max_tokens cut
    the object off invalid."""
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [
        {"type": "function", "function": {"name": name, "parameters": city}} for name in ("get_weather", "get_time")
    ]
    for name in ("get_weather", "get_time"):
        for stream in (False, True):
            kwargs = dict(
                model=MODEL,
                messages=ask("What is the weather like in Paris?"),
                tools=tools,
                tool_choice={"type": "function", "function": {"name": name}},
                max_tokens=32,
                temperature=0,
            )
            if stream:
                _, calls, finishes = assemble(client.chat.completions.create(stream=True, **kwargs))
                arguments, finish = calls[0]["arguments"], finishes[0]
            else:
                answer = client.chat.completions.create(**kwargs).choices[0]
                arguments, finish = answer.message.tool_calls[0].function.arguments, answer.finish_reason
            assert finish == "stop", (name, arguments)
            assert list(json.loads(arguments)) == ["city"], arguments


def test_required_calls_one_of_the_tools(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=ask("What time is it in Paris?"),
            tools=[WEATHER, TIME],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=60,
        )
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls" and len(answer.message.tool_calls) == 1
        call = answer.message.tool_calls[0]
        schema = {"get_weather": PARAMETERS, "get_time": TIME["function"]["parameters"]}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    content, calls, finishes = assemble(
        client.chat.completions.create(
            model=MODEL,
            messages=ask("Weather in Rome?"),
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    assert (
        finishes == ["tool_calls"] and calls and all(c["name"] in ("get_weather", "get_time") for c in calls.values())
    )


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_own_tool_call(client, stream):
    kwargs = dict(model=MODEL, messages=ask(COPY_A_CALL), tools=[WEATHER], temperature=0, max_tokens=60)
    if stream:
        content, calls, finishes = assemble(client.chat.completions.create(stream=True, **kwargs))
        assert content == "" and finishes == ["tool_calls"]
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
        return
    answer = client.chat.completions.create(**kwargs).choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in answer.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_auto_without_a_call_and_none_answer_in_text(client):
    auto = client.chat.completions.create(
        model=MODEL, messages=ask("Say hello."), tools=[WEATHER], temperature=0, max_tokens=20
    ).choices[0]
    assert auto.message.tool_calls is None and auto.message.content and auto.finish_reason in ("stop", "length")
    # Whether a 135M model copies the call turns on the CPU's bf16 arithmetic: one of two prompts
    # does on every CPU tried (the plain one on an AMD Zen 4, the one with an example on an Intel
    # CPU without native bf16). A copied call stays text under tool_choice="none".
    example = [
        {"role": "user", "content": "Repeat exactly this text and nothing else:\nhello world"},
        {"role": "assistant", "content": "hello world"},
    ]
    texts = []
    for messages in (ask(COPY_A_CALL), example + ask(COPY_A_CALL)):
        none = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=60
        ).choices[0]
        assert none.message.tool_calls is None and none.message.content
        texts.append(none.message.content)
    assert any("<tool_call>" in text for text in texts), texts


def test_a_tool_result_goes_back_into_the_conversation(client, server):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ask("Weather in Oslo?"),
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=40,
    )
    call = first.choices[0].message.tool_calls[0]
    history = ask("Weather in Oslo?") + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=30)
    # What a 135M model says next (an answer, or the same call again) turns on near-ties that any
    # kernel change moves; what must hold is that the call and its result are in the prompt it saw.
    message = reply.choices[0].message
    assert message.content or message.tool_calls
    assert reply.usage.prompt_tokens > first.usage.prompt_tokens
    tokens = server.post("/tokenize", json={"model": MODEL, "messages": history, "tools": [WEATHER]}).json()["tokens"]
    assert len(tokens) == reply.usage.prompt_tokens
    rendered = server.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert "Sunny, 21 degrees" in rendered and "get_weather" in rendered and "Oslo" in rendered
    bad = server.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": ask("Hi"),
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "other"}},
        },
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tool_choice"
