"""Faults injected into real processes: the pool keeps serving and loses nothing."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import MODEL, Server, free_port, spawn, start_serve, wait_until

FAST = {"LLMPOOL_HEARTBEAT_INTERVAL": "0.5", "LLMPOOL_HEARTBEAT_LIVENESS": "4"}


@pytest.fixture
def pool() -> Iterator[tuple[Server, dict]]:
    """A gateway and two float32 workers (float32: a resumed greedy stream must match exactly)."""
    server = Server(free_port(), free_port())
    server.processes.append(spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address], "faults-gateway", FAST))
    workers = {}
    for name in ("w-a", "w-b"):
        workers[name] = spawn(["worker", "--gateway-address", server.zmq_address, "--worker-name", name, "--dtype", "float32",
                               "--threads", "1"], f"faults-{name}", FAST)
        server.processes.append(workers[name])
    try:
        server.wait_for_workers(2)
        yield server, workers
    finally:
        server.stop()


def stream_text(client: openai.OpenAI, on_chunk=None) -> tuple[str, int]:  # noqa: ANN001
    text, count, usage = [], 0, None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a walk through an old forest."}],
        max_tokens=48, temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            count += 1
            if on_chunk:
                on_chunk(count)
    return "".join(text), usage.completion_tokens


def test_sigkilled_worker_mid_stream_the_stream_resumes_on_the_other_worker(pool):
    server, workers = pool
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    reference, reference_tokens = stream_text(client)
    killed: list[str] = []

    def kill_serving_worker(count: int) -> None:
        if count == 12 and not killed:
            (busy,) = [w["name"] for w in server.workers() if w["inflight"]]
            workers[busy].send_signal(signal.SIGKILL)
            killed.append(busy)

    resumed, resumed_tokens = stream_text(client, kill_serving_worker)
    assert killed, "a worker should have been killed mid-stream"
    assert resumed == reference, "the resumed stream must read exactly like the uninterrupted one"
    assert resumed_tokens == reference_tokens == 48
    snapshot = server.get("/workers").json()
    assert snapshot["resumed"] == 1 and [w["name"] for w in snapshot["workers"]] != killed


def test_a_draining_worker_finishes_its_requests_and_gets_no_new_ones(pool):
    server, workers = pool
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    drained: list[str] = []
    assigned_before: dict[str, int] = {}

    def drain_serving_worker(count: int) -> None:
        if count == 5 and not drained:
            (busy,) = [w for w in server.workers() if w["inflight"]]
            assigned_before.update({w["name"]: w["requests_assigned"] for w in server.workers()})
            workers[busy["name"]].send_signal(signal.SIGTERM)
            drained.append(busy["name"])
            wait_until(lambda: any(w["draining"] for w in server.workers()), 10, "the worker to announce its drain")
            for _ in range(3):  # new work goes to the other worker while the drain runs
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)

    text, tokens = stream_text(client, drain_serving_worker)
    assert drained and tokens == 48 and text, "the stream finished on the draining worker, uninterrupted"
    name = drained[0]
    assert workers[name].wait(timeout=30) == 0, "a drained worker exits cleanly"
    wait_until(lambda: [w["name"] for w in server.workers()] == [n for n in workers if n != name], 10, "the drained worker to leave")
    assert server.get("/workers").json()["resumed"] == 0, "nothing had to be moved"
    others = {w["name"]: w["requests_assigned"] for w in server.workers()}
    assert all(others[n] >= assigned_before[n] + 3 for n in others)


def test_sigterm_on_the_launcher_lets_running_streams_finish():
    server = start_serve("serve-graceful", 1)
    launcher = server.processes[0]
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        text, tokens = stream_text(client, lambda count: count == 5 and launcher.send_signal(signal.SIGTERM))
        assert tokens == 48 and text
        assert launcher.wait(timeout=60) == 0
    finally:
        server.stop()
