"""Each dialect's route over the core, in process: Litestar's test client, the real routes, checks
and templates, and a fake worker client in place of the fleet (no worker processes, no sockets).
What each dialect translates its body into (the wire request the fleet would get), what it
translates the core's answer back into, and its error shapes (OpenAI's for chat, completions and
responses; Anthropic's for messages)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from litestar import Litestar
from litestar.di import Provide
from litestar.testing import TestClient

from common.protocol import FinishReason, NewRequest, RequestOutput
from gateway.errors import EXCEPTION_HANDLERS
from gateway.fleet.workers import UNTRACED, RequestStream, Trace
from gateway.generate.lanes import Lanes
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.served_model import ServedModel
from gateway.generate.templates import ChatTemplate
from gateway.http.app import DEPENDENCIES
from gateway.http.request_body import GatewayRequest
from gateway.http.routes.chat import ChatController
from gateway.http.routes.completions import CompletionsController
from gateway.http.routes.messages import MessagesController
from gateway.http.routes.responses import ResponsesController
from gateway.ops.metrics import Metrics
from gateway.policy.admission import Admission
from gateway.state.service import StateService

REPLY = " Hello there, friend"


class FakeFleet:
    """The worker client without workers: each request is answered at once with REPLY's tokens
    (as many as its budget takes), and kept in ``submitted`` for the test to read."""

    def __init__(self, tokenizer) -> None:
        self.models = {"m": SimpleNamespace(workers={})}
        self.reply = tokenizer.encode(REPLY, add_special_tokens=False)
        self.submitted: list[NewRequest] = []

    def limits(self, model: str) -> tuple[int, int]:
        return 2048, 1 << 20  # context length, KV capacity in tokens

    def available(self, model: str) -> list:
        return [object()]

    def submit(self, request: NewRequest, model: str, trace: Trace = UNTRACED, delivered=None) -> RequestStream:
        self.submitted.append(request)
        stream = RequestStream(request, model, trace)
        ids = self.reply[: request.max_new_tokens]
        finish = FinishReason.LENGTH if len(ids) < len(self.reply) else FinishReason.STOP
        stream.deliver(RequestOutput(request.request_id, ids, finish, len(request.prompt_token_ids), len(ids)))
        stream.finished = True
        return stream

    def abort(self, request_id: str) -> None:
        pass

    def snapshot(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def fleet(tokenizer):
    return FakeFleet(tokenizer)


@pytest.fixture(scope="module")
def client(tokenizer, fleet):
    admission = Admission(8, 8)
    lanes = Lanes(1)
    registry = ModelRegistry(fleet, Metrics(fleet.snapshot, admission), admission, lanes, 30.0)
    template = ChatTemplate(
        tokenizer.chat_template, {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    )
    registry.served_models["m"] = ServedModel(
        fleet, tokenizer, template, "m", lanes, registry.metrics, admission, 30.0, rules=registry.rules
    )
    stored = StateService.__new__(StateService)  # unstored responses only: the store is never read
    app = Litestar(
        route_handlers=[ChatController, CompletionsController, ResponsesController, MessagesController],
        dependencies={
            **DEPENDENCIES,
            "models": Provide(lambda: registry, sync_to_thread=False),
            "stored": Provide(lambda: stored, sync_to_thread=False),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        request_class=GatewayRequest,
    )
    with TestClient(app) as test_client:
        yield test_client
    lanes.close()


def sent(fleet: FakeFleet) -> NewRequest:
    return fleet.submitted[-1]


def openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    return error


def sse(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]


# Chat


def test_chat_translates_its_body_and_answers_a_completion(client, fleet, tokenizer):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3, "stop": ["zz"]}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    request = sent(fleet)
    assert request.max_new_tokens == 3 and request.sampling.temperature == 1.0
    assert "Hi" in tokenizer.decode(request.prompt_token_ids)
    choice = answer.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": tokenizer.decode(fleet.reply[:3])}
    assert choice["finish_reason"] == "length"
    assert answer.json()["usage"]["prompt_tokens"] == len(request.prompt_token_ids)
    assert answer.headers["x-request-id"] == request.request_id


def test_chat_streams_chunks_and_done(client, fleet):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    answer = client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "chat-stream-1"})
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    chunks = sse(answer)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == REPLY
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert sent(fleet).request_id.startswith("chat-stream-1-")  # the caller's X-Request-Id, made unique


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
def test_chat_errors_name_the_field_in_openais_shape(client, body, status, param):
    openai_error(client.post("/v1/chat/completions", json=body), status, param)


# Completions


def test_completions_translate_a_prompt_and_answer_its_text(client, fleet, tokenizer):
    answer = client.post("/v1/completions", json={"model": "m", "prompt": "Once upon", "max_tokens": 2, "n": 2})
    assert answer.status_code == 200, answer.text
    requests = fleet.submitted[-2:]  # one wire request per choice
    assert [r.max_new_tokens for r in requests] == [2, 2]
    assert tokenizer.decode(requests[0].prompt_token_ids).endswith("Once upon")
    assert [c["text"] for c in answer.json()["choices"]] == [tokenizer.decode(fleet.reply[:2])] * 2
    assert answer.json()["object"] == "text_completion"


def test_completions_stream(client):
    answer = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "stream": True})
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
def test_completions_errors_name_the_field(client, body, param):
    openai_error(client.post("/v1/completions", json=body), 400, param)


# Responses


def test_responses_translate_input_and_answer_output_items(client, fleet, tokenizer):
    body = {"model": "m", "input": "Hi there", "instructions": "Be brief", "max_output_tokens": 2, "store": False}
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    prompt = tokenizer.decode(sent(fleet).prompt_token_ids)
    assert "Be brief" in prompt and "Hi there" in prompt
    response = answer.json()
    assert response["object"] == "response" and response["status"] == "incomplete"
    assert response["output"][0]["content"][0]["text"] == tokenizer.decode(fleet.reply[:2])
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}


def test_responses_stream_named_events(client):
    answer = client.post("/v1/responses", json={"model": "m", "input": "Hi", "stream": True, "store": False})
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
def test_responses_errors_name_the_field(client, body, param):
    openai_error(client.post("/v1/responses", json=body), 400, param)


# Messages (Anthropic)


def test_messages_translate_system_and_answer_content_blocks(client, fleet, tokenizer):
    body = {"model": "m", "max_tokens": 2, "system": "Be kind", "messages": [{"role": "user", "content": "Hi"}]}
    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == 200, answer.text
    prompt = tokenizer.decode(sent(fleet).prompt_token_ids)
    assert "Be kind" in prompt and "Hi" in prompt
    message = answer.json()
    assert message["type"] == "message" and message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": tokenizer.decode(fleet.reply[:2])}]


def test_messages_stream_anthropics_events(client):
    body = {"model": "m", "max_tokens": 50, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    answer = client.post("/v1/messages", json=body)
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
def test_messages_errors_come_in_anthropics_shape(client, body):
    answer = client.post("/v1/messages", json=body)
    assert answer.status_code == 400, answer.text
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error" and error["error"]["message"]
