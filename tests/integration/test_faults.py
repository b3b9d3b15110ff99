"""Faults injected into real processes: the pool keeps serving and loses nothing."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
import zmq

from tests.conftest import ARTIFACTS, MODEL, Server, free_port, spawn, wait_until, worker_argv
from tests.gateway.test_worker_client import eventually

FAST = {"LLMPOOL_HEARTBEAT_INTERVAL": "0.5", "LLMPOOL_HEARTBEAT_LIVENESS": "4"}


@pytest.fixture(scope="module", autouse=True)
def fresh_report() -> None:
    (ARTIFACTS / "fault-report.jsonl").unlink(missing_ok=True)


class Pool:
    """A gateway and two float32 workers (float32: a resumed greedy stream must match exactly), one
    for the module: each test gets it whole, its killed or drained workers replaced by new ones."""

    def __init__(self) -> None:
        self.server = Server(free_port(), free_port())
        self.workers: dict[str, subprocess.Popen] = {}
        self.started = 0
        self.start_gateway("faults-gateway")
        for _ in range(2):
            self.start_worker()

    def start_gateway(self, log: str) -> None:
        """As the gateway (``processes[0]``), a new one writing to ``log``."""
        argv = ["gateway", "--port", str(self.server.port), "--zmq-bind", self.server.zmq_address]
        self.log = ARTIFACTS / f"{log}.log"
        process = spawn(argv, log, FAST)
        if self.server.processes:
            self.server.processes[0] = process
        else:
            self.server.processes.append(process)

    def start_worker(self) -> None:
        name, self.started = f"w-{self.started}", self.started + 1  # a new name: the dead one's may linger
        argv = worker_argv(self.server.zmq_address, name, "--dtype", "float32", "--threads", "1")
        self.workers[name] = spawn(argv, f"faults-{name}", FAST)
        self.server.processes.append(self.workers[name])

    def heal(self) -> tuple[Server, dict]:
        for name, process in list(self.workers.items()):
            if process.poll() is not None:
                del self.workers[name]
                self.start_worker()
        wanted = sorted(self.workers)
        wait_until(lambda: sorted(w["name"] for w in self.server.workers()) == wanted, 180, "the pool's two workers")
        self.server.wait_idle(60, "the pool idle")
        return self.server, self.workers


@pytest.fixture(scope="module")
def whole_pool() -> Iterator[Pool]:
    pool = Pool()
    try:
        yield pool
    finally:
        pool.server.stop()


@pytest.fixture
def pool(whole_pool: Pool) -> tuple[Server, dict]:
    return whole_pool.heal()


def moved_so_far(server: Server) -> int:
    """Streams the gateway has moved to another worker so far."""
    return server.get("/workers").json()["resumed"]


WALK = {  # bounded, so the guided answer always finishes
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 3, "maxItems": 3},
    },
    "required": ["title", "steps"],
    "additionalProperties": False,
}
GUIDED = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "walk", "schema": WALK}},
    "max_tokens": 200,
}
FREE = {"max_tokens": 48, "extra_body": {"ignore_eos": True}}


def stream_text(client: openai.OpenAI, on_chunk=None, kind: dict = FREE) -> tuple[str, int]:
    text, count, usage = [], 0, None
    for chunk in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a walk through an old forest."}],
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        **kind,
    ):
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            count += 1
            if on_chunk:
                on_chunk(count)
    return "".join(text), usage.completion_tokens


@pytest.mark.parametrize("kind", [FREE, GUIDED], ids=["free", "guided-json"])
def test_sigkilled_worker_mid_stream_the_stream_resumes_on_the_other_worker(pool, kind):
    """The resumed stream reads exactly like the uninterrupted one; a guided one's grammar picks up
    where the dead worker left it (the new worker replays the tokens already generated)."""
    server, workers = pool
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    reference, reference_tokens = stream_text(client, kind=kind)
    moved = moved_so_far(server)
    killed: list[str] = []

    def kill_serving_worker(count: int) -> None:
        if count == 12 and not killed:
            (busy,) = [w["name"] for w in server.workers() if w["inflight"]]
            workers[busy].send_signal(signal.SIGKILL)
            killed.append(busy)

    resumed, resumed_tokens = stream_text(client, kill_serving_worker, kind)
    assert killed, "a worker should have been killed mid-stream"
    assert resumed == reference, "the resumed stream must read exactly like the uninterrupted one"
    assert resumed_tokens == reference_tokens
    if kind is FREE:
        assert resumed_tokens == 48
    else:
        jsonschema.validate(json.loads(resumed), WALK)
    snapshot = server.get("/workers").json()
    assert snapshot["resumed"] == moved + 1 and [w["name"] for w in snapshot["workers"]] != killed
    report(test="sigkill", served=2, disconnected=0, faults=1, lost=0)


def test_a_draining_worker_finishes_its_requests_and_gets_no_new_ones(pool):
    server, workers = pool
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    drained: list[str] = []
    assigned_before: dict[str, int] = {}
    moved = moved_so_far(server)

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
    wait_until(
        lambda: sorted(w["name"] for w in server.workers()) == sorted(n for n in workers if n != name),
        10,
        "the drained worker to leave",
    )
    assert moved_so_far(server) == moved, "nothing had to be moved"
    others = {w["name"]: w["requests_assigned"] for w in server.workers()}
    assert all(others[n] >= assigned_before[n] + 3 for n in others)
    report(test="drain", served=4, disconnected=0, faults=0, lost=0)


def report(**counts: int) -> None:
    """Append what a fault test did (requests served, clients gone, faults injected, requests lost)."""
    ARTIFACTS.mkdir(exist_ok=True)
    with open(ARTIFACTS / "fault-report.jsonl", "a") as out:
        out.write(json.dumps(counts) + "\n")


def test_a_stopped_worker_is_detected_its_stream_resumes_and_it_rejoins_after_sigcont(pool):
    server, workers = pool
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    reference, _ = stream_text(client)
    stopped: list[str] = []

    def stop_serving_worker(count: int) -> None:
        if count == 10 and not stopped:
            (busy,) = [w["name"] for w in server.workers() if w["inflight"]]
            workers[busy].send_signal(signal.SIGSTOP)
            stopped.append(busy)

    try:
        text, tokens = stream_text(client, stop_serving_worker)
        assert stopped and text == reference and tokens == 48
        assert stopped[0] not in [w["name"] for w in server.workers()]
    finally:
        for name in stopped:
            workers[name].send_signal(signal.SIGCONT)
    # Back from SIGCONT, it finds the gateway silent towards it, reconnects and registers afresh.
    wait_until(
        lambda: sorted(w["name"] for w in server.workers()) == sorted(workers), 30, "the stopped worker to rejoin"
    )
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    ).choices
    report(test="sigstop", served=3, disconnected=0, faults=1, lost=0)


def test_workers_rejoin_a_restarted_gateway(whole_pool):
    server, _ = whole_pool.heal()
    gateway = server.processes[0]
    gateway.send_signal(signal.SIGTERM)
    gateway.wait(timeout=30)
    whole_pool.start_gateway("faults-gateway-2")
    server.wait_for_workers(2, timeout=60)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    ).choices
    report(test="gateway-restart", served=1, disconnected=0, faults=1, lost=0)


def test_malformed_frames_on_the_router_port_are_dropped(server):
    """Runs on the shared server (it harms no worker): junk from a stranger is counted and dropped."""
    dropped = server.get("/workers").json()["dropped_frames"]
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    stranger.setsockopt(zmq.LINGER, 2000)  # deliver what was sent before closing
    stranger.connect(server.zmq_address)
    junk = [
        [b"hello"],
        [b"\x01\x05", b"\xc1\xc1"],
        [b"\x09\x01", b""],
        [b"\x01\x63", b"x"],
        [os.urandom(64), os.urandom(4096)],
        [b"\x01\x01", b"\x81\xa3bad\x01"],
    ]
    for frames in junk:
        stranger.send_multipart(frames)
    stranger.close()
    context.term()
    wait_until(
        lambda: server.get("/workers").json()["dropped_frames"] >= dropped + len(junk) - 1, 10, "the junk to be counted"
    )
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    ).choices
    assert len(server.workers()) == 2
    report(test="malformed-frames", served=1, disconnected=0, faults=len(junk), lost=0)


def test_200_streaming_clients_with_random_disconnects(server):
    """200 concurrent streams; about a third hang up early. Every other stream completes with correct
    framing, and afterwards no KV block is left allocated anywhere. (On the shared server: it ends
    with the workers as it found them.)"""
    rng = random.Random(7)
    plan = [rng.random() < 0.33 for _ in range(200)]  # True: hang up after a few chunks

    async def one(i: int, hang_up: bool) -> str:
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Say something about {i}."}],
                "max_tokens": 16,
                "stream": True,
                "ignore_eos": True,
            }
        ).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        raw = b""
        try:
            while True:
                data = await asyncio.wait_for(reader.read(65536), 300)
                if not data:
                    break
                raw += data
                if hang_up and raw.count(b"data: ") >= 3:
                    return "disconnected"
        finally:
            writer.close()
        head, _, body_bytes = raw.partition(b"\r\n\r\n")
        assert b" 200 " in head.split(b"\r\n")[0], head[:100]
        events = [e.split("\n", 1)[-1] for e in decode_chunked(body_bytes).decode().split("\n\n")]  # ids dropped
        assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and len({c["id"] for c in chunks}) == 1
        return "completed"

    async def everyone() -> list[str]:
        return await asyncio.gather(*(one(i, hang_up) for i, hang_up in enumerate(plan)))

    outcomes = asyncio.run(everyone())
    assert outcomes.count("completed") == plan.count(False)
    server.wait_idle(30, "every KV block back after the storm")
    assert server.get("/workers").json()["inflight"] == 0
    report(
        test="200-clients",
        served=outcomes.count("completed"),
        disconnected=outcomes.count("disconnected"),
        faults=0,
        lost=0,
    )


def decode_chunked(body: bytes) -> bytes:
    out = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        out, body = out + rest[:size], rest[size + 2 :]
    return out


def _metric(server: Server, line_start: str) -> float:
    lines = [line for line in server.get("/metrics").text.splitlines() if line.startswith(line_start)]
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_a_client_hanging_up_on_a_plain_request_is_a_499_not_a_500(server):
    """The generation is aborted and counted as the client's leaving: no InvalidStateError, no
    unretrieved exception in the log, no 500 in the metrics."""
    path = '/v1/chat/completions",status='
    log = ARTIFACTS / "serve-session.log"
    log_start = log.stat().st_size
    before = {s: _metric(server, f'llmpool_http_requests_total{{path="{path}"{s}"}}') for s in ("499", "500")}
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400,
            "ignore_eos": True,
        }
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(head.encode() + body)
        wait_until(lambda: any(w["inflight"] for w in server.workers()), 10, "the generation to start")
    key = f'llmpool_http_requests_total{{path="{path}"499"}}'
    wait_until(lambda: _metric(server, key) == before["499"] + 1, 10, "the hang-up to be counted as a 499")
    wait_until(lambda: not any(w["inflight"] for w in server.workers()), 10, "the generation to be aborted")
    assert _metric(server, f'llmpool_http_requests_total{{path="{path}"500"}}') == before["500"]
    logged = log.read_bytes()[log_start:].decode(errors="replace")
    assert "InvalidStateError" not in logged and "never retrieved" not in logged


def test_a_request_naming_tokens_the_model_lacks_fails_alone_among_16_streams(pool):
    """The issue's request (min_tokens with stop_token_ids [999999] or [2**63]), chat and legacy, sent
    while 16 greedy streams run on two float32 workers: each bad one gets a 400 of its own, and every
    stream ends normally with the same text as without them."""
    server, _ = pool
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

    running: set[int] = set()  # streams that have their first chunk

    async def stream(i: int) -> tuple[str, str]:
        parts, finish = [], None
        async for chunk in await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Name a colour and a number, {i}."}],
            temperature=0,
            max_tokens=24,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            running.add(i)
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def bad(path: str, ids: list[int]) -> tuple[int, dict]:
        body = {"model": MODEL, "max_tokens": 8, "min_tokens": 2, "stop_token_ids": ids}
        body |= {"messages": [{"role": "user", "content": "hi"}]} if path == "chat/completions" else {"prompt": "hi"}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            response = await http.post(f"/v1/{path}", json=body)
        return response.status_code, response.json()

    async def run(with_bad: bool) -> tuple[list, list]:
        running.clear()
        streams = [asyncio.create_task(stream(i)) for i in range(16)]
        refused = []
        if with_bad:
            await eventually(lambda: len(running) == 16, 120)  # every stream is running
            refused = await asyncio.gather(
                *(bad(p, ids) for p in ("chat/completions", "completions") for ids in ([999999], [2**63]))
            )
        return await asyncio.gather(*streams), refused

    reference, _ = asyncio.run(run(False))
    texts, refused = asyncio.run(run(True))
    assert all(finish == "length" and text for text, finish in reference)
    assert texts == reference
    for status, body in refused:
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    report(test="bad-token-ids", served=16, disconnected=0, faults=len(refused), lost=0)


def test_a_prompt_of_booleans_is_answered_at_once_and_no_worker_is_blamed(server):
    """``[true, false]`` as token ids used to vanish on the worker (the whole message failed to
    decode): the client waited 180 s for a 500 while idle workers were declared hung. Now the
    worker answers that request with an error of its own."""
    departed = len(server.get("/workers").json()["departed"])
    response = httpx.post(
        server.base_url + "/v1/completions", timeout=20, json={"model": MODEL, "prompt": [True, False], "max_tokens": 4}
    )
    assert response.status_code == 400, response.text
    assert response.elapsed.total_seconds() < 10 and response.json()["error"]["type"] == "invalid_request_error"
    assert server.get("/ready").status_code == 200 and len(server.workers()) == 2
    assert len(server.get("/workers").json()["departed"]) == departed


def test_a_gateway_paused_for_4_s_blames_no_worker_and_every_stream_completes(whole_pool):
    """SIGSTOP on the gateway for 4 s, twice its workers' liveness (0.5 s x 4): the workers'
    messages wait unread in its socket, so when it runs again that time is not their silence. Every
    stream ends normally with the text it has without the pause (float32; a worker that gave up on
    the silent gateway and re-registered has its requests resumed exactly)."""
    server, _ = whole_pool.heal()
    gateway = server.processes[0]
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

    running: set[int] = set()  # streams that have their first chunk

    async def stream(i: int) -> tuple[str, str, int]:
        parts, finish, usage = [], None, None
        async for chunk in await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Describe the number {i}."}],
            temperature=0,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            running.add(i)
            usage = chunk.usage or usage
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish, usage.completion_tokens

    async def run(pause: bool) -> list:
        running.clear()
        streams = [asyncio.create_task(stream(i)) for i in range(16)]
        if pause:
            await eventually(lambda: len(running) == 16, 120)  # every stream is running
            assert not any(s.done() for s in streams), "the streams should still be running"
            gateway.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(4)  # the pause itself: twice the workers' liveness (past it is what counts)
            finally:
                gateway.send_signal(signal.SIGCONT)
        return await asyncio.gather(*streams, return_exceptions=True)

    reference = asyncio.run(run(False))
    assert all(finish == "length" and tokens == 64 for _, finish, tokens in reference)
    log = whole_pool.log
    log_start = log.stat().st_size
    paused = asyncio.run(run(True))
    assert paused == reference
    logged = log.read_bytes()[log_start:].decode(errors="replace")
    assert "did not run for" in logged and "missed 4 heartbeats" not in logged
    report(test="gateway-sigstop", served=16, disconnected=0, faults=1, lost=0)
