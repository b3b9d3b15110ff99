"""Anthropic's Messages API through the anthropic SDK against the real server: create, stream,
stop sequences, tools, tool results, count_tokens, prompt-cache usage and Anthropic-shaped errors."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.conftest import MODEL

GREEDY = {"temperature": 0}  # current SDKs have no temperature argument: clients send it in the body
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
    },
}
SYSTEM = (
    "You are a friendly assistant who answers every question briefly, in one short sentence. " * 4
)  # > 64 tokens: affinity


@pytest.fixture(scope="module")
def claude(server):  # an anthropic.Anthropic
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_create_and_its_usage(claude):
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        system=[{"type": "text", "text": SYSTEM}],
        messages=ask("Say hello."),
        extra_body=GREEDY,
    )
    assert (
        reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_") and reply.model == MODEL
    )
    assert reply.content[0].type == "text" and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    # The same request again: its prompt now comes from the prefix cache. (Its text may differ from the
    # first one's after a near-tie: bf16 and int8 decoding are close to, not identical across, shapes.)
    again = claude.messages.create(
        model=MODEL, max_tokens=40, system=SYSTEM, messages=ask("Say hello."), extra_body=GREEDY
    )
    assert again.content[0].type == "text" and again.content[0].text
    assert again.usage.cache_read_input_tokens > 0, "the prefix cache served it"
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ask("Say hello."))
    assert (
        again.usage.input_tokens + again.usage.cache_read_input_tokens
        == counted.input_tokens
        == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    )
    cut = claude.messages.create(model=MODEL, max_tokens=3, messages=ask("Tell me a long story."))
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


def test_stop_sequences_end_with_stop_sequence_set(claude):
    whole = claude.messages.create(
        model=MODEL, max_tokens=40, messages=ask("Count from one to ten in words."), extra_body=GREEDY
    )
    text = whole.content[0].text
    words = text.split()
    assert len(words) > 3, text
    stop = words[2]
    cut = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=ask("Count from one to ten in words."),
        stop_sequences=[stop],
        extra_body=GREEDY,
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]


def test_stream_events_in_anthropics_order(server, claude):
    body = {"model": MODEL, "max_tokens": 30, "messages": ask("Say hello."), "stream": True, **GREEDY}
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "prompt-caching-2024-07-31"}
    with httpx.stream(
        "POST", server.base_url + "/v1/messages?beta=true", json=body, headers=headers, timeout=120
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert data[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens") and data[-2]["usage"]["output_tokens"] > 0
    streamed = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
    assert streamed and data[0]["message"]["model"] == MODEL
    # The SDK folds the same events into the final message (a second bf16 greedy run may take a
    # near-tie the other way, from the prefix cache: compare the SDK with its own stream).
    with claude.messages.stream(model=MODEL, max_tokens=30, messages=ask("Say hello."), extra_body=GREEDY) as stream:
        sdk_streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == sdk_streamed and final.stop_reason in ("end_turn", "max_tokens")


def test_tools_any_and_a_named_tool_streamed_then_the_result_fed_back(claude):
    # Greedy: at Anthropic's default temperature 1 a 135M model can ramble in a string until max_tokens.
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "any"},
        messages=ask("Weather in Oslo?"),
        extra_body=GREEDY,
    )
    assert reply.stop_reason == "tool_use"
    (use,) = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    with claude.messages.stream(
        model=MODEL,
        max_tokens=40,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ask("Weather in Rome?"),
        extra_body=GREEDY,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds or "content_block_delta" in kinds
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=30,
        tools=[WEATHER],
        extra_body=GREEDY,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
        ],
    )
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    none = claude.messages.create(
        model=MODEL, max_tokens=10, tools=[WEATHER], tool_choice={"type": "none"}, messages=ask("Hi")
    )
    assert all(b.type == "text" for b in none.content)


def test_errors_take_anthropics_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError) as image:
        claude.messages.create(
            model=MODEL,
            max_tokens=10,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
                        }
                    ],
                }
            ],
        )
    assert image.value.body["type"] == "error" and image.value.body["error"]["type"] == "invalid_request_error"
    assert (
        "messages[0].content[0]" in image.value.body["error"]["message"]
        and "image" in image.value.body["error"]["message"]
    )
    with pytest.raises(anthropic.NotFoundError) as unknown:
        claude.messages.create(model="not-a-served-model", max_tokens=10, messages=ask("Hi"))
    assert unknown.value.body["error"]["type"] == "not_found_error"
    missing = server.post("/v1/messages", json={"model": MODEL, "messages": ask("Hi")})
    assert missing.status_code == 400 and missing.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": missing.json()["error"]["message"]},
    }
    assert "max_tokens" in missing.json()["error"]["message"]
    server_tool = server.post(
        "/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 5,
            "messages": ask("Hi"),
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
    )
    assert server_tool.status_code == 400 and "tools[0].type" in server_tool.json()["error"]["message"]
    too_long = server.post("/v1/messages", json={"model": MODEL, "max_tokens": 9000, "messages": ask("Hi")})
    assert too_long.status_code == 400 and too_long.json()["error"]["type"] == "invalid_request_error"


def test_a_streams_opening_usage_counts_prefix_cache_reads_as_its_closing_usage_does(claude):
    """message_start's usage splits the prompt as message_delta's does: cache reads apart."""
    prompt = dict(model=MODEL, max_tokens=4, system=SYSTEM, messages=ask("Name a colour."), extra_body=GREEDY)
    claude.messages.create(**prompt)  # the prompt is in the prefix cache now
    with claude.messages.stream(**prompt) as stream:
        events = list(stream)
    opening = next(e for e in events if e.type == "message_start").message.usage
    closing = next(e for e in events if e.type == "message_delta").usage
    assert opening.cache_read_input_tokens > 0 and opening.cache_read_input_tokens == closing.cache_read_input_tokens
    assert opening.input_tokens == closing.input_tokens
