"""Two gateways sharing one real PostgreSQL server, a float32 worker serving both: stored responses
are the fleet's, scoped to their key, billed per key; background responses are polled and cancelled
through either gateway; and streams whose gateway is SIGKILLed resume through the other, token for
token the same as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.conftest import MODEL, free_port, spawn, stop, wait_until, worker_argv
from tests.integration.test_tokens_io import aborted_mid_stream

KEYS = ("fleet-k1", "fleet-k2")
ADMIN = "fleet-admin"


class StateFleet:
    def __init__(self, state_url: str) -> None:
        self.state_url = state_url
        self.zmq = [free_port(), free_port()]
        self.http = [free_port(), free_port()]
        self.gateways: list = [None, None]
        self.env = {"LLMPOOL_API_KEY": ",".join(KEYS), "LLMPOOL_ADMIN_KEY": ADMIN, "LLMPOOL_STATE_URL": state_url}
        self.worker = None
        self.worker_args: list[str] = []

    def start_gateway(self, i: int) -> None:
        args = ["gateway", "--port", str(self.http[i]), "--zmq-bind", f"tcp://127.0.0.1:{self.zmq[i]}"]
        self.gateways[i] = spawn(args, f"state-gateway-{'ab'[i]}", self.env)

    def start_worker(self, name: str) -> None:
        """The one worker, registered with both gateways."""
        addresses = ",".join(f"tcp://127.0.0.1:{port}" for port in self.zmq)
        self.worker = spawn(worker_argv(addresses, None, *self.worker_args), name, self.env)

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.http[i]}"

    def sdk(self, i: int, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(i) + "/v1", api_key=key, max_retries=0, timeout=120)

    def get(self, i: int, path: str, key: str = KEYS[0]) -> httpx.Response:
        return httpx.get(self.url(i) + path, headers={"Authorization": f"Bearer {key}"}, timeout=30)

    def ready(self, i: int) -> bool:
        return self.get(i, "/ready").status_code == 200

    def run(self, worker_args: list[str], name: str) -> Iterator[StateFleet]:
        """Both gateways and one worker serving both (a module fixture's body)."""
        try:
            self.start_gateway(0)
            self.start_gateway(1)
            self.worker_args = worker_args
            self.start_worker(name)
            for i in (0, 1):
                wait_until(lambda i=i: self.ready(i), 240, f"gateway {i} ready")
            yield self
        finally:
            for process in [self.worker, *self.gateways]:
                if process is not None:
                    stop(process)


@pytest.fixture(scope="module")
def fleet(postgres):
    yield from StateFleet(postgres.database("state_fleet")).run(
        ["--dtype", "float32", "--model", MODEL], "state-worker"
    )


def test_a_conversation_goes_on_through_the_other_gateway_and_stays_its_keys(fleet):
    a, b = fleet.sdk(0), fleet.sdk(1)
    first = a.responses.create(
        model=MODEL, input="My name is Ada. Say OK.", max_output_tokens=8, temperature=0, metadata={"turn": "1"}
    )
    second = b.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=8, temperature=0
    )
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    assert b.responses.retrieve(first.id).output_text == first.output_text and b.responses.retrieve(
        first.id
    ).metadata == {"turn": "1"}
    (item,) = list(b.responses.input_items.list(second.id))
    assert item.type == "message" and item.content[0].text == "What is my name?"
    other = fleet.sdk(1, KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.create(model=MODEL, input="And mine?", previous_response_id=first.id, max_output_tokens=4)
    assert refused.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    b.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(first.id)


def test_usage_is_billed_per_key_for_the_admin_only(fleet):
    fleet.sdk(0, KEYS[1]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert fleet.get(0, "/v1/usage").status_code == 401, "an API key is not the admin key"

    def billed() -> dict:
        rows = fleet.get(1, "/v1/usage", key=ADMIN).json()["data"]
        return {row["key"]: row for row in rows if row["model"] == MODEL}

    # Gateway A adds its counts to the store each heartbeat; B reads them there.
    wait_until(lambda: len(billed()) == 2, 30, "both keys billed")
    from gateway.state.records import key_label, owner_of

    rows = billed()
    assert (
        rows[key_label(owner_of(KEYS[1]))]["output_tokens"] >= 3 and rows[key_label(owner_of(KEYS[0]))]["requests"] >= 2
    )
    assert KEYS[0] not in str(rows), "keys are never shown, only their digests"
    metrics = fleet.get(0, "/metrics").text
    assert f'llmpool_key_tokens_total{{key="{key_label(owner_of(KEYS[1]))}",kind="output",model="{MODEL}"}}' in metrics


def test_background_responses_are_polled_and_cancelled_through_either_gateway(fleet):
    a, b = fleet.sdk(0), fleet.sdk(1)
    started = a.responses.create(model=MODEL, input="Say hello.", background=True, max_output_tokens=12, temperature=0)
    assert started.status in ("queued", "in_progress") and started.background
    wait_until(
        lambda: b.responses.retrieve(started.id).status in ("completed", "incomplete"),
        60,
        "the background response done",
    )
    done = b.responses.retrieve(started.id)
    assert done.output_text and done.usage.output_tokens > 0
    long = a.responses.create(
        model=MODEL,
        input="Tell me a very long story.",
        background=True,
        max_output_tokens=2000,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    cancelled = b.responses.cancel(long.id)  # A runs it; B asks the store, A stops it at its next heartbeat
    assert cancelled.status == "cancelled" and a.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        b.responses.cancel(a.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id)


PROMPTS = [
    f"Write a long story about a {animal} who {deed}."
    for animal in ("cat", "dog", "fox", "owl")
    for deed in ("sails", "sings", "cooks", "flies")
]
TOKENS = 20


def _create(client: openai.OpenAI, prompt: str):
    return client.responses.create(
        model=MODEL,
        input=prompt,
        background=True,
        stream=True,
        max_output_tokens=TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def test_an_abort_sent_to_the_other_gateway_stops_a_generate_stream(fleet):
    """A router may send /abort_requests to any gateway of the fleet: B passes the id it does not run
    on through the store, and A, which runs it, stops it at its next heartbeat."""
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    answer, finishes = aborted_mid_stream(fleet.url(0), fleet.url(1), ["fleet-abort-me"], auth)
    assert answer == {"aborted": [], "passed_on": ["fleet-abort-me"]}, answer
    assert finishes[-1] == "abort" and len(finishes) < 2000


def test_streams_resume_on_the_other_gateway_after_theirs_is_killed(fleet):
    """16 background streams through A; A is SIGKILLed once each has shown a few deltas; each client
    resumes through B from the last event it saw. B takes the generations over (from the tokens A
    logged) and every text equals the uninterrupted run's, token for token (float32, greedy)."""
    b = fleet.sdk(1)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: _final_text(_create(b, p)), PROMPTS))
    assert all(reference)

    a = fleet.sdk(0)
    seen = threading.Barrier(len(PROMPTS) + 1, timeout=180)

    def client(prompt: str) -> tuple[str, str, list[int]]:
        stream = _create(a, prompt)
        deltas, numbers, response_id = [], [], None
        try:
            for event in stream:
                numbers.append(event.sequence_number)
                response_id = response_id or event.response.id
                if event.type == "response.output_text.delta":
                    deltas.append(event.delta)
                    if len(deltas) == 3:
                        seen.wait()  # every stream is mid-way: now A dies
        except (httpx.HTTPError, openai.APIError):
            pass
        resumed = b.responses.retrieve(response_id, stream=True, starting_after=numbers[-1])
        for event in resumed:
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            final = event
        assert final.type == "response.incomplete", final.type  # ignore_eos: it ends at max_output_tokens
        assert final.response.output_text == "".join(deltas)
        return response_id, "".join(deltas), numbers

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(client, p) for p in PROMPTS]
        seen.wait()
        fleet.gateways[0].send_signal(signal.SIGKILL)
        fleet.gateways[0].wait()
        results = [f.result(timeout=300) for f in futures]
    for (response_id, text, numbers), expected in zip(results, reference):
        assert numbers == list(range(len(numbers))), "every event once, in order"
        assert text == expected, response_id
        assert (
            b.responses.retrieve(response_id).output_text == expected
            and b.responses.retrieve(response_id).usage.output_tokens == TOKENS
        )


def _final_text(stream) -> str:
    events = list(stream)
    assert events[-1].type == "response.incomplete"
    return events[-1].response.output_text


STORY = "Write a long story about a cat who sails."
STREAMS = {  # dialect: (path, streamed body); Messages has no ignore_eos, its greedy story runs past 20 tokens
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": STORY}], "ignore_eos": True}),
    "completions": ("/v1/completions", {"prompt": STORY, "ignore_eos": True}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": STORY}]}),
}


def _sse(response: httpx.Response) -> Iterator[dict]:
    """Server-sent events as dicts of their fields (id, event, data)."""
    event: dict = {}
    for line in response.iter_lines():
        if not line:
            if event:
                yield event
            event = {}
            continue
        name, _, value = line.partition(": ")
        event[name] = value


def _delta(dialect: str, event: dict) -> str:
    if event["data"] == "[DONE]":
        return ""
    data = json.loads(event["data"])
    if dialect == "messages":
        return data.get("delta", {}).get("text", "") if data["type"] == "content_block_delta" else ""
    choice = data["choices"][0] if data.get("choices") else {}
    return (choice.get("delta", {}).get("content") or "") if dialect == "chat" else choice.get("text", "")


def _post(fleet: StateFleet, i: int, dialect: str, last_id: str | None = None, **extra):
    path, body = STREAMS[dialect]
    headers = {"Authorization": f"Bearer {KEYS[0]}", **({"Last-Event-ID": last_id} if last_id else {})}
    body = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "stream": True, **body, **extra}
    return httpx.stream("POST", fleet.url(i) + path, json=body, headers=headers, timeout=120)


def test_every_dialects_stream_resumes_on_the_other_gateway_with_last_event_id(fleet):
    """Chat, completions and Messages streams through A (restarted if an earlier test killed it); A is
    SIGKILLed mid-stream; each client sends its request again to B with Last-Event-ID and the text is
    the uninterrupted run's; a ``store: false`` stream cannot be resumed."""
    if fleet.gateways[0].poll() is not None:
        fleet.start_gateway(0)
        wait_until(lambda: fleet.ready(0), 240, "gateway A back")
    reference = {}
    for dialect in STREAMS:
        with _post(fleet, 1, dialect) as response:
            events = list(_sse(response))
        assert all(e["id"] == f"{events[0]['id'].rpartition('/')[0]}/{n}" for n, e in enumerate(events)), events
        reference[dialect] = "".join(_delta(dialect, e) for e in events)
    seen = threading.Barrier(len(STREAMS) + 1, timeout=120)

    def client(dialect: str) -> tuple[str, list[str]]:
        text, ids = "", []
        try:
            with _post(fleet, 0, dialect) as response:
                if response.status_code != 200:
                    seen.abort()  # fail now, not at the barrier's timeout
                    raise AssertionError(response.read())
                for event in _sse(response):
                    ids.append(event["id"])
                    text += _delta(dialect, event)
                    if len(ids) == 4:
                        seen.wait()  # every stream is mid-way: now A dies
        except httpx.HTTPError:
            pass
        with _post(fleet, 1, dialect, last_id=ids[-1]) as response:
            assert response.status_code == 200, response.read()
            for event in _sse(response):
                ids.append(event["id"])
                text += _delta(dialect, event)
        return text, ids

    with ThreadPoolExecutor(len(STREAMS)) as pool:
        futures = {dialect: pool.submit(client, dialect) for dialect in STREAMS}
        seen.wait()
        fleet.gateways[0].send_signal(signal.SIGKILL)
        fleet.gateways[0].wait()
        results = {dialect: future.result(timeout=180) for dialect, future in futures.items()}
    for dialect, (text, ids) in results.items():
        stream = ids[0].rpartition("/")[0]
        assert ids == [f"{stream}/{n}" for n in range(len(ids))], f"{dialect}: every event once, in order"
        assert text == reference[dialect], dialect
    with _post(fleet, 1, "chat", store=False) as response:
        first = next(_sse(response))["id"]
    with _post(fleet, 1, "chat", last_id=first) as response:
        assert response.status_code == 404, "store: false streams are not logged"
