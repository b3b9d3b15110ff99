"""Each dialect's route over the core, in process: Litestar's test client, the real routes, checks
and templates, and a fake worker client in place of the fleet (tests/gateway/conftest.py: no worker
processes, no sockets). What each dialect translates its body into (the wire request the fleet
would get), what it translates the core's answer back into, and its error shapes (OpenAI's for
chat, completions and responses; Anthropic's for messages)."""

from __future__ import annotations

import json

import pytest

from common.protocol import NewRequest
from tests.gateway.conftest import REPLY, FakeFleet


def sent(fake_fleet: FakeFleet) -> NewRequest:
    return fake_fleet.submitted[-1]


def openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    return error


def sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


# Chat


def test_chat_translates_its_body_and_answers_a_completion(inproc, fake_fleet, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3, "stop": ["zz"]}
    answer = inproc.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    request = sent(fake_fleet)
    assert request.max_new_tokens == 3 and request.sampling.temperature == 1.0
    assert "Hi" in tokenizer.decode(request.prompt_token_ids)
    choice = answer.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(fake_fleet.reply[:3])}
    assert choice["finish_reason"] == "length"
    assert answer.json()["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    assert answer.headers["x-request-id"] == request.request_id


def test_chat_streams_chunks_and_done(inproc, fake_fleet):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    answer = inproc.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "chat-stream-1"})
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    chunks = sse(answer)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert sent(fake_fleet).request_id.startswith("chat-stream-1-")  # the caller's X-Request-Id, made unique


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "m", "messages": []}, 400, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "priority": 3}, 400, "priority"),
        ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ],
)
def test_chat_errors_name_the_field_in_openais_shape(inproc, body, status, param):
    openai_error(inproc.post("/v1/chat/completions", json=body), status, param)


# Completions


def test_completions_translate_a_prompt_and_answer_its_text(inproc, fake_fleet, tokenizer):
    answer = inproc.post("/v1/completions", json={"model": "m", "prompt": "Once upon", "max_tokens": 2, "n": 2})
    assert answer.status_code == 200, answer.text
    requests = fake_fleet.submitted[-2:]  # one wire request per choice
    assert [r.max_new_tokens for r in requests] == [2, 2]
    assert tokenizer.decode(requests[0].prompt_token_ids).endswith("Once upon")
    assert [c["text"] for c in answer.json()["choices"]] == [tokenizer.decode(fake_fleet.reply[:2])] * 2
    assert answer.json()["object"] == "text_completion"


def test_completions_stream(inproc):
    answer = inproc.post("/v1/completions", json={"model": "m", "prompt": "Hi", "stream": True})
    assert "".join(c["choices"][0]["text"] for c in sse(answer)) == REPLY
    assert answer.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": [[-1]]}, "prompt"),
    ],
)
def test_completions_errors_name_the_field(inproc, body, param):
    openai_error(inproc.post("/v1/completions", json=body), 400, param)


# Responses


def test_responses_translate_input_and_answer_output_items(inproc, fake_fleet, tokenizer):
    body = {"model": "m", "input": "Hi there", "instructions": "Be brief", "max_output_tokens": 2, "store": False}
    answer = inproc.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    prompt = tokenizer.decode(sent(fake_fleet).prompt_token_ids)
    assert "Be brief" in prompt and "Hi there" in prompt
    response = answer.json()
    assert response["object"] == "response" and response["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == tokenizer.decode(fake_fleet.reply[:2])
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_stream_named_events(inproc):
    answer = inproc.post("/v1/responses", json={"model": "m", "input": "Hi", "stream": True, "store": False})
    events = [line[7:] for line in answer.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "[DONE]" not in answer.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "input": "x", "background": True, "store": False}, "background"),
        ({"model": "m", "input": "x", "prompt": {"id": "p"}, "store": False}, "prompt"),
        ({"model": "m", "input": [], "store": False}, "input"),
    ],
)
def test_responses_errors_name_the_field(inproc, body, param):
    openai_error(inproc.post("/v1/responses", json=body), 400, param)


# Messages (Anthropic)


def test_messages_translate_system_and_answer_content_blocks(inproc, fake_fleet, tokenizer):
    body = {"model": "m", "max_tokens": 2, "system": "Be kind", "messages": [{"role": "user", "content": "Hi"}]}
    answer = inproc.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    prompt = tokenizer.decode(sent(fake_fleet).prompt_token_ids)
    assert "Be kind" in prompt and "Hi" in prompt
    message = answer.json()
    assert message["type"] == "message" and message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": tokenizer.decode(fake_fleet.reply[:2])}]


def test_messages_stream_anthropics_events(inproc):
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    answer = inproc.post("/v1/messages", json=body)
    events = [line[7:] for line in answer.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    deltas = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")]
    assert "".join(d["delta"].get("text", "") for d in deltas if d["type"] == "content_block_delta") == REPLY


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "max_tokens": 5, "messages": []},
        {"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
        {"model": "m", "messages": [{"role": "user", "content": "x"}]},  # no max_tokens
    ],
)
def test_messages_errors_come_in_anthropics_shape(inproc, body):
    answer = inproc.post("/v1/messages", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
