"""OpenAI's Responses API through the OpenAI SDK (client.responses) against the real server:
plain and streamed, tools, structured output, stored responses and previous_response_id."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.conftest import MODEL

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]},
}


INSTRUCTIONS = (
    "You are a friendly assistant who answers every question briefly, in one short sentence. " * 4
)  # > 64 tokens: affinity


def test_a_plain_response_and_an_incomplete_one(client):
    reply = client.responses.create(
        model=MODEL, input="Say hello.", instructions=INSTRUCTIONS, max_output_tokens=40, temperature=0
    )
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.status in ("completed", "incomplete")
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert reply.output_text and reply.output_text == message.content[0].text
    assert (
        reply.usage.input_tokens > 0
        and reply.usage.output_tokens > 0
        and reply.usage.input_tokens_details.cached_tokens >= 0
    )
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    type(reply).model_validate(reply.model_dump())  # every field the SDK's type requires is there
    again = client.responses.create(
        model=MODEL, input="Say hello.", instructions=INSTRUCTIONS, max_output_tokens=40, temperature=0
    )
    # Served from the prefix cache (bf16 greedy text may flip a near-tie there: test_api's closeness test covers that).
    assert again.output_text and again.usage.input_tokens_details.cached_tokens > 0, "the prefix cache served it"
    cut = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me a long story."}]}],
        max_output_tokens=5,
    )
    assert (
        cut.status == "incomplete"
        and cut.incomplete_details.reason == "max_output_tokens"
        and cut.usage.output_tokens == 5
    )


def test_streamed_events_come_in_openais_order(client):
    # A budget the answer never reaches (its length turns on the CPU's bf16 arithmetic: 20-60 tokens).
    events = list(
        client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert (
        text == final.output_text == events[-4].text and final.status == "completed" and final.usage.output_tokens > 0
    )
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0)
    # A second bf16 greedy run may flip a near-tie (its prompt comes from the prefix cache): the
    # non-streamed body is checked for its own shape, the streamed text against its own events above.
    assert whole.output_text and whole.status == "completed" and whole.usage.output_tokens > 0


def test_function_tools_named_required_and_the_result_fed_back(client):
    named = client.responses.create(
        model=MODEL,
        input="What's the weather in Oslo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    (call,) = named.output
    assert (
        call.type == "function_call"
        and call.name == "get_weather"
        and call.call_id.startswith("call_")
        and call.status == "completed"
    )
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])

    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Rome?",
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather" and json.loads(done.arguments) == json.loads(
        events[-1].response.output[0].arguments
    )

    answer = client.responses.create(
        model=MODEL,
        tools=[WEATHER],
        max_output_tokens=30,
        temperature=0,
        input=[
            {"role": "user", "content": "What's the weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
    )
    assert answer.status in ("completed", "incomplete") and answer.output


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


def test_structured_output_json_schema_and_parse(client):
    fmt = {"type": "json_schema", "name": "city", "strict": True, "schema": City.model_json_schema()}
    reply = client.responses.create(
        model=MODEL, input="Tell me about Rome.", text={"format": fmt}, max_output_tokens=60, temperature=0
    )
    City.model_validate_json(reply.output_text)
    assert reply.text.format.type == "json_schema"
    parsed = client.responses.parse(
        model=MODEL, input="Tell me about Paris.", text_format=City, max_output_tokens=60, temperature=0
    )
    assert isinstance(parsed.output_parsed, City)
    obj = client.responses.create(
        model=MODEL,
        input="Describe a cat as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=60,
        temperature=0,
    )
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


def test_stored_responses_continue_and_can_be_read_and_deleted(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say OK.", max_output_tokens=10, temperature=0)
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=20, temperature=0
    )
    assert second.previous_response_id == first.id
    fresh = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=20, temperature=0)
    assert second.usage.input_tokens > fresh.usage.input_tokens + first.usage.output_tokens, (
        "the earlier turn is part of the prompt"
    )
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=first.id)
    assert refused.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"background": True, "store": False}, "background"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"note": "v" * 513}}, "metadata.note"),
        ({"metadata": {"n": 5}}, "metadata.n"),
        ({"user": "u" * 65}, "user"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
            "input[0].content[0].image_url",  # a text-only model takes no images
        ),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"max_output_tokens": 9000}, "max_output_tokens"),
        ({"input": 5}, "input"),
    ],
)
def test_unsupported_or_bad_fields_are_400s_naming_the_field(server, body, param):
    response = server.post("/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_reasoning_on_a_model_that_does_not_think_reports_none_and_the_short_path_works(server):
    response = server.post(
        "/responses",
        json={
            "model": MODEL,
            "input": "Hi",
            "max_output_tokens": 4,
            "reasoning": {"effort": "low"},
            "include": ["reasoning.encrypted_content"],
            "truncation": "auto",
        },
    )
    assert response.status_code == 200 and response.json()["usage"]["output_tokens_details"]["reasoning_tokens"] == 0


def test_echoed_defaults_are_openais(server):
    body = server.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2}).json()
    assert body["tool_choice"] == "auto" and body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}


def test_input_items_are_listed_in_pages_and_scoped(client):
    items = [{"role": "user", "content": f"Remember the number {n}."} for n in range(3)]
    reply = client.responses.create(model=MODEL, input=items, max_output_tokens=4)
    listed = list(client.responses.input_items.list(reply.id, limit=2, order="asc"))  # two pages
    assert [item.content[0].text for item in listed] == [item["content"] for item in items]
    assert len({item.id for item in listed}) == 3
    newest = client.responses.input_items.list(reply.id, limit=1)
    assert newest.data[0].id == listed[-1].id and newest.has_more


def test_a_conversation_keeps_its_turns(client):
    conversation = client.conversations.create(
        items=[{"role": "user", "content": "My name is Ada."}], metadata={"topic": "names"}
    )
    assert conversation.id.startswith("conv_") and client.conversations.retrieve(conversation.id).metadata == {
        "topic": "names"
    }
    reply = client.responses.create(
        model=MODEL, input="What is my name?", conversation=conversation.id, max_output_tokens=12, temperature=0
    )
    fresh = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=12, temperature=0)
    assert reply.usage.input_tokens > fresh.usage.input_tokens, "the conversation's items are in the prompt"
    items = list(client.conversations.items.list(conversation.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[-1].content[0].text == reply.output_text
    client.conversations.items.delete(items[0].id, conversation_id=conversation.id)
    assert len(list(client.conversations.items.list(conversation.id))) == 2
    assert client.conversations.update(conversation.id, metadata={"topic": "other"}).metadata == {"topic": "other"}
    assert client.conversations.delete(conversation.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conversation.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="Hi", conversation=conversation.id, max_output_tokens=2)
