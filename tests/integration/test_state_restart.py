"""The default store, a SQLite file, across gateway restarts: responses survive (GET, continuation,
input items), a body over --state-max-response-bytes (2 KiB here) is a 400 unless unstored, and a gateway with a
short --state-max-age purges in the background what has expired."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import MODEL, free_port, spawn, stop, wait_until, worker_argv


class Gateway:
    def __init__(self, state_file: str) -> None:
        self.port, self.zmq = free_port(), free_port()
        self.env = {"LLMPOOL_STATE_URL": f"sqlite:///{state_file}", "LLMPOOL_STATE_MAX_RESPONSE_BYTES": "2048"}
        self.process = None
        self.client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", max_retries=0, timeout=120
        )

    def start(self, **env: str) -> None:
        args = ["gateway", "--port", str(self.port), "--zmq-bind", f"tcp://127.0.0.1:{self.zmq}"]
        self.process = spawn(args, "state-restart-gateway", {**self.env, **env})
        url = f"http://127.0.0.1:{self.port}/ready"
        wait_until(lambda: httpx.get(url, timeout=5).status_code == 200, 180, "the worker registered again")

    def restart(self, **env: str) -> None:
        stop(self.process)
        self.start(**env)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    gateway = Gateway(str(tmp_path_factory.mktemp("state") / "state.db"))
    worker = spawn(worker_argv(f"tcp://127.0.0.1:{gateway.zmq}"), "state-restart-worker")
    try:
        gateway.start()
        yield gateway
    finally:
        stop(gateway.process)
        stop(worker)


def test_a_body_over_the_response_budget_is_refused_unless_unstored(gateway):
    big = "word " * 500  # 2,500 bytes of input: over the 2,048-byte budget
    with pytest.raises(openai.BadRequestError) as refused:
        gateway.client.responses.create(model=MODEL, input=big, max_output_tokens=2)
    assert refused.value.body["code"] == "response_too_large"
    assert gateway.client.responses.create(model=MODEL, input=big, max_output_tokens=2, store=False).status in (
        "completed",
        "incomplete",
    )


def test_responses_survive_a_restart_and_expired_ones_are_purged(gateway):
    client = gateway.client
    first = client.responses.create(model=MODEL, input="My name is Ada. Say OK.", max_output_tokens=8, temperature=0)
    gateway.restart()
    client = gateway.client
    assert client.responses.retrieve(first.id).output_text == first.output_text
    assert [item.content[0].text for item in client.responses.input_items.list(first.id)] == ["My name is Ada. Say OK."]
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert second.usage.input_tokens > first.usage.input_tokens
    # Now with a 3-second retention: the purge (every second here) removes both, in the background.
    gateway.restart(LLMPOOL_STATE_MAX_AGE="3s", LLMPOOL_STATE_PURGE_INTERVAL="1")
    third = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(third.id).id == third.id

    def purged() -> bool:
        try:
            client.responses.retrieve(third.id)
        except openai.NotFoundError:
            return True
        return False

    wait_until(purged, 30, "the expired response purged")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
