"""Chaos soak: two float32 workers under mixed traffic of all four dialects (chat streams, n, guided
JSON, tools, completions, Responses, Messages), clients that hang up, bad inputs, and hostile
connections (an oversized header, a slow sender, a body shorter than its Content-Length, a silent
connection) for several rounds; one worker is SIGKILLed and restarted midway, and the gateway gets
a SIGTERM during the last round. It must end with nothing lost and no request left hanging, every
greedy text equal to its reference (float32: batch-independent), every KV block free, no traceback
in any log, the gateway's and the surviving worker's memory flat after warm-up, and the gateway
finishing its in-flight streams before it exits."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.conftest import ARTIFACTS, MODEL, Server, free_port, spawn, wait_until, worker_argv

FAST = {"LLMPOOL_HEARTBEAT_INTERVAL": "0.5", "LLMPOOL_HEARTBEAT_LIVENESS": "4"}
ROUNDS = 3  # the suite keeps to 30 minutes: 3 rounds kill (round 2), serve on the restarted worker and stop as 6 did
KILL_ROUND = 2
WALK = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40}},
    "required": ["title"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


CHAT, COMPLETIONS, RESPONSES, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
# Greedy requests whose answers are known in advance (name -> path, body); each round sends every one.
GREEDY = {
    "stream": (
        CHAT,
        {
            "messages": ask("Describe a walk through an old forest."),
            "max_tokens": 24,
            "ignore_eos": True,
            "stream": True,
        },
    ),
    "n2": (CHAT, {"messages": ask("Name three rivers."), "max_tokens": 16, "ignore_eos": True, "n": 2}),
    "json": (
        CHAT,
        {
            "messages": ask("Give a title for a story about a fox, as JSON."),
            "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": WALK}},
        },
    ),
    "tool": (
        CHAT,
        {
            "messages": ask("What is the weather in Oslo?"),
            "max_tokens": 30,
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    ),
    "long": (
        CHAT,
        {
            "messages": ask("Tell a story about a lighthouse keeper."),
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
        },
    ),
    "completion": (COMPLETIONS, {"prompt": "The three primary colours are", "max_tokens": 16, "ignore_eos": True}),
    "responses": (RESPONSES, {"input": "Describe a quiet harbour.", "max_output_tokens": 16, "ignore_eos": True}),
    "messages": (
        MESSAGES,
        {"messages": ask("Describe a mountain village."), "max_tokens": 16, "ignore_eos": True, "stream": True},
    ),
}
BAD = [
    (CHAT, {"messages": ask("hi"), "stop_token_ids": [True]}),
    (CHAT, {"messages": ask("hi"), "logit_bias": {"²": 1}}),
    (CHAT, {"messages": [], "max_tokens": 2}),
    (CHAT, {"messages": ask("hi"), "n": 99}),
    (RESPONSES, {"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}),
    (RESPONSES, {"input": "hi", "max_output_tokens": "5"}),
    (MESSAGES, {"messages": [{"role": "user", "content": []}], "max_tokens": 4}),
    (MESSAGES, {"messages": ask("hi"), "max_tokens": "10"}),
]
HOSTILE = ("big-header", "slow-sender", "short-body", "silent")
GATEWAY_LIMITS = ["--header-timeout", "2", "--body-timeout", "2", "--keep-alive-timeout", "5"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


ANSWERING = threading.local()  # .started: this thread's request got its response headers


def answer(http: httpx.Client, base: str, path: str, body: dict) -> list[str]:
    """The texts (or tool-call arguments) of every choice, streamed or not, in any dialect."""
    payload = {"model": MODEL, "temperature": 0, **body}
    ANSWERING.started = False
    if not body.get("stream"):
        response = http.post(base + path, json=payload)
        response.raise_for_status()
        ANSWERING.started = True
        found = response.json()
        if path == RESPONSES:
            return [found["output"][0]["content"][0]["text"]]
        if path == COMPLETIONS:
            return [c["text"] for c in found["choices"]]
        return [
            c["message"]["content"] or c["message"]["tool_calls"][0]["function"]["arguments"] for c in found["choices"]
        ]
    text = []
    with http.stream("POST", base + path, json=payload) as response:
        response.raise_for_status()
        ANSWERING.started = True
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if path == MESSAGES:
                text.append(event["delta"].get("text", "") if event["type"] == "content_block_delta" else "")
            else:
                text += [choice["delta"].get("content") or "" for choice in event["choices"]]
    return ["".join(text)]


def hostile(port: int, kind: str) -> bytes:
    """A client the HTTP layer must turn away (gateway/http/server.py): what the gateway answered
    before it closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        try:
            if kind == "big-header":
                sock.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (8 << 20))
            elif kind == "slow-sender":
                for byte in b"GET /health HTTP/1.1\r\n":
                    sock.send(bytes([byte]))
                    time.sleep(0.5)
            elif kind == "short-body":
                sock.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 4000000\r\n\r\n{"
                    + b" " * 1_000_000
                )
        except OSError:
            pass  # the gateway closed it while we were still sending
        answer, chunk = b"", b"x"
        try:
            while chunk:
                chunk = sock.recv(65536)
                answer += chunk
        except ConnectionResetError:
            pass
        return answer


def cancel(http: httpx.Client, url: str) -> None:
    """A client that hangs up after three chunks."""
    body = {
        "model": MODEL,
        "messages": ask("Count to one hundred."),
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
    }
    with http.stream("POST", url + CHAT, json=body) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break


def start_worker(server: Server, name: str):  # a Popen
    args = worker_argv(server.zmq_address, name, "--dtype", "float32", "--threads", "1", "--kv-cache-memory", "256MiB")
    return spawn(args, f"soak-{name}", FAST)


@pytest.mark.slow
def test_chaos_soak_all_dialects_hostile_clients_a_worker_killed_and_the_gateway_stopped():
    for log in ARTIFACTS.glob("soak-*.log"):
        log.unlink()
    server = Server(free_port(), free_port())
    gateway = spawn(
        ["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address, *GATEWAY_LIMITS], "soak-gateway", FAST
    )
    workers = {name: start_worker(server, name) for name in ("w-a", "w-b")}
    server.processes += [gateway, *workers.values()]
    url = server.base_url
    counts: Counter = Counter()
    mismatches: list[str] = []
    failures: list[str] = []
    hung: list[str] = []
    stopping = threading.Event()  # set with the gateway's SIGTERM: connections it no longer takes are not losses
    try:
        server.wait_for_workers(2)
        with httpx.Client(timeout=120) as http:
            reference = {name: answer(http, url, *request) for name, request in GREEDY.items()}  # one at a time, alone
        assert reference["n2"][0] == reference["n2"][1]

        def one(kind: str, request: tuple[str, dict] | None = None) -> None:
            with httpx.Client(timeout=120) as http:
                try:
                    if kind == "cancel":
                        cancel(http, url)
                        counts["disconnected"] += 1
                    elif kind == "bad":
                        path, body = request  # type: ignore[misc]
                        status = http.post(url + path, json={"model": MODEL, **body}).status_code
                        counts["refused" if status == 400 else "unexpected"] += 1
                    elif kind in HOSTILE:
                        status = hostile(server.port, kind)[9:12]
                        counts["repelled" if status in (b"", b"408", b"431") else "unexpected"] += 1
                    else:
                        got = answer(http, url, *GREEDY[kind])
                        counts["served"] += 1
                        if got != reference[kind]:
                            mismatches.append(f"{kind}: {got!r} != {reference[kind]!r}")
                except Exception as exc:  # a lost request, unless the stopping gateway never took it
                    if (
                        stopping.is_set()
                        and not getattr(ANSWERING, "started", False)
                        and isinstance(exc, (httpx.TransportError, OSError))
                    ):
                        counts["turned away while stopping"] += 1
                    else:
                        failures.append(f"{kind}: {type(exc).__name__}: {exc}")

        def round_(number: int, fault=None) -> None:  # what to do once requests are in flight
            jobs = [threading.Thread(target=one, args=(kind,), name=kind) for kind in GREEDY for _ in range(2)]
            jobs += [threading.Thread(target=one, args=("cancel",), name="cancel") for _ in range(2)]
            jobs += [threading.Thread(target=one, args=("bad", request), name="bad") for request in BAD]
            jobs += [threading.Thread(target=one, args=(kind,), name=kind) for kind in HOSTILE]
            for job in jobs:
                job.start()
            if fault is not None:
                wait_until(lambda: sum(w["inflight"] for w in server.workers()) >= 8, 30, "requests in flight")
                fault()
                counts["faults"] += 1
            deadline = time.monotonic() + 120  # no request may hang: each ends, answered or refused
            for job in jobs:
                job.join(max(0.0, deadline - time.monotonic()))
            hung.extend(f"round {number}: {job.name}" for job in jobs if job.is_alive())

        def kill_a_worker() -> None:
            workers["w-a"].send_signal(signal.SIGKILL)
            workers["w-a"] = start_worker(server, "w-a")
            server.processes.append(workers["w-a"])

        round_(0)  # warm-up
        memory = {"gateway": rss_kib(gateway.pid), "w-b": rss_kib(workers["w-b"].pid)}
        started = time.monotonic()
        for number in range(1, ROUNDS):
            round_(number, kill_a_worker if number == KILL_ROUND else None)
        server.wait_for_workers(2)
        round_(ROUNDS)  # the restarted worker serves too

        server.wait_idle(20, "every KV block free and nothing in flight")
        assert len(server.workers()) == 2
        after = {"gateway": rss_kib(gateway.pid), "w-b": rss_kib(workers["w-b"].pid)}
        resumed = server.get("/workers").json()["resumed"]
        # SIGTERM mid-round: the streams in flight finish (--shutdown-grace), then the gateway exits.
        # Requests it refuses while stopping count apart; none may hang or come back wrong.
        before_stop = counts["served"]
        round_(ROUNDS + 1, lambda: (stopping.set(), gateway.send_signal(signal.SIGTERM)))
        assert gateway.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
        elapsed = time.monotonic() - started
    finally:
        server.stop()
    tracebacks = [log.name for log in ARTIFACTS.glob("soak-*.log") if "Traceback" in log.read_text(errors="replace")]
    lost = len(failures) + counts["unexpected"]
    print(
        f"\nsoak: {dict(counts)} resumed={resumed} lost={lost} in {elapsed:.0f} s; RSS KiB after warm-up {memory}, at the end {after}"
    )
    from tests.integration.test_faults import report

    report(
        test="soak", served=counts["served"], disconnected=counts["disconnected"], faults=counts["faults"], lost=lost
    )
    assert not hung, hung
    assert not failures and lost == 0, failures
    assert resumed >= 1, "the killed worker's requests should have moved to the other one"
    assert not mismatches, mismatches[:3]
    assert counts["served"] > before_stop, "streams in flight at the SIGTERM should have finished"
    assert counts["refused"] >= len(BAD) * (ROUNDS + 1) and counts["repelled"] >= len(HOSTILE) * (ROUNDS + 1)
    assert not tracebacks, tracebacks
    for name, before in memory.items():  # flat: no more than 10% + 40 MiB above the warmed-up size
        assert after[name] <= before * 1.1 + 40 * 1024, (name, before, after[name])
