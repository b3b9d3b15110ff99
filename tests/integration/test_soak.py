"""Soak: two float32 workers under mixed traffic (streams, n, guided JSON, tools, cancels, bad
inputs) for several rounds, one worker SIGKILLed and restarted midway. It must end with nothing
lost, every greedy text equal to its reference (float32: batch-independent), every KV block free,
no traceback in any log, and the gateway's and the surviving worker's memory flat after warm-up."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.conftest import ARTIFACTS, MODEL, Server, free_port, spawn, wait_until

FAST = {"LLMPOOL_HEARTBEAT_INTERVAL": "0.5", "LLMPOOL_HEARTBEAT_LIVENESS": "4"}
ROUNDS = 6
KILL_ROUND = 2
WALK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40}}, "required": ["title"], "additionalProperties": False}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
    },
}


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# Greedy requests whose answers are known in advance (name -> body); each round sends every one.
GREEDY = {
    "stream": {"messages": ask("Describe a walk through an old forest."), "max_tokens": 24, "ignore_eos": True, "stream": True},
    "n2": {"messages": ask("Name three rivers."), "max_tokens": 16, "ignore_eos": True, "n": 2},
    "json": {
        "messages": ask("Give a title for a story about a fox, as JSON."),
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": WALK}},
    },
    "tool": {
        "messages": ask("What is the weather in Oslo?"),
        "max_tokens": 30,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    },
    "long": {"messages": ask("Tell a story about a lighthouse keeper."), "max_tokens": 64, "ignore_eos": True, "stream": True},
}
BAD = [
    {"messages": ask("hi"), "stop_token_ids": [True]},
    {"messages": ask("hi"), "logit_bias": {"²": 1}},
    {"messages": [], "max_tokens": 2},
    {"messages": ask("hi"), "n": 99},
]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def answer(http: httpx.Client, url: str, body: dict) -> list[str]:
    """The texts (or tool-call arguments) of every choice, streamed or not."""
    payload = {"model": MODEL, "temperature": 0, **body}
    if not body.get("stream"):
        response = http.post(url, json=payload)
        response.raise_for_status()
        choices = response.json()["choices"]
        return [c["message"]["content"] or c["message"]["tool_calls"][0]["function"]["arguments"] for c in choices]
    text = []
    with http.stream("POST", url, json=payload) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    return ["".join(text)]


def cancel(http: httpx.Client, url: str) -> None:
    """A client that hangs up after three chunks."""
    body = {"model": MODEL, "messages": ask("Count to one hundred."), "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", url, json=body) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 3:
                break


def start_worker(server: Server, name: str):  # noqa: ANN201 - a Popen
    args = [
        "worker",
        "--gateway-address",
        server.zmq_address,
        "--worker-name",
        name,
        "--dtype",
        "float32",
        "--threads",
        "1",
        "--kv-cache-memory",
        "256MiB",
    ]
    return spawn(args, f"soak-{name}", FAST)


@pytest.mark.slow
def test_soak_mixed_traffic_with_a_worker_killed_midway():
    for log in ARTIFACTS.glob("soak-*.log"):
        log.unlink()
    server = Server(free_port(), free_port())
    gateway = spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address], "soak-gateway", FAST)
    workers = {name: start_worker(server, name) for name in ("w-a", "w-b")}
    server.processes += [gateway, *workers.values()]
    url = server.base_url + "/v1/chat/completions"
    counts: Counter = Counter()
    mismatches: list[str] = []
    failures: list[str] = []
    try:
        server.wait_for_workers(2)
        with httpx.Client(timeout=120) as http:
            reference = {name: answer(http, url, body) for name, body in GREEDY.items()}  # one at a time, alone
        assert reference["n2"][0] == reference["n2"][1]

        def one(kind: str, body: dict | None = None) -> None:
            with httpx.Client(timeout=120) as http:
                try:
                    if kind == "cancel":
                        cancel(http, url)
                        counts["disconnected"] += 1
                    elif kind == "bad":
                        status = http.post(url, json={"model": MODEL, **(body or {})}).status_code
                        counts["refused" if status == 400 else "unexpected"] += 1
                    else:
                        got = answer(http, url, GREEDY[kind])
                        counts["served"] += 1
                        if got != reference[kind]:
                            mismatches.append(f"{kind}: {got!r} != {reference[kind]!r}")
                except Exception as exc:  # a lost request
                    failures.append(f"{kind}: {type(exc).__name__}: {exc}")

        def round_(number: int) -> None:
            jobs = [threading.Thread(target=one, args=(kind,)) for kind in GREEDY for _ in range(2)]
            jobs += [threading.Thread(target=one, args=("cancel",)) for _ in range(2)]
            jobs += [threading.Thread(target=one, args=("bad", body)) for body in BAD]
            for job in jobs:
                job.start()
            if number == KILL_ROUND:  # mid-round: requests are in flight on both workers
                wait_until(lambda: all(w["inflight"] for w in server.workers()), 30, "both workers busy")
                workers["w-a"].send_signal(signal.SIGKILL)
                counts["faults"] += 1
                workers["w-a"] = start_worker(server, "w-a")
                server.processes.append(workers["w-a"])
            for job in jobs:
                job.join()

        round_(0)  # warm-up
        memory = {"gateway": rss_kib(gateway.pid), "w-b": rss_kib(workers["w-b"].pid)}
        started = time.monotonic()
        for number in range(1, ROUNDS):
            round_(number)
        server.wait_for_workers(2)
        round_(ROUNDS)  # the restarted worker serves too
        elapsed = time.monotonic() - started

        def all_free() -> bool:
            listed = server.workers()
            return len(listed) == 2 and all(w["inflight"] == 0 and w["free_blocks"] == w["total_blocks"] for w in listed)

        wait_until(all_free, 20, "every KV block free and nothing in flight")
        after = {"gateway": rss_kib(gateway.pid), "w-b": rss_kib(workers["w-b"].pid)}
        resumed = server.get("/workers").json()["resumed"]
    finally:
        server.stop()
    tracebacks = [log.name for log in ARTIFACTS.glob("soak-*.log") if "Traceback" in log.read_text(errors="replace")]
    lost = len(failures) + counts["unexpected"]
    print(f"\nsoak: {dict(counts)} resumed={resumed} lost={lost} in {elapsed:.0f} s; RSS KiB after warm-up {memory}, at the end {after}")
    from tests.integration.test_faults import report

    report(test="soak", served=counts["served"], disconnected=counts["disconnected"], faults=counts["faults"], lost=lost)
    assert not failures and lost == 0, failures
    assert resumed >= 1, "the killed worker's requests should have moved to the other one"
    assert not mismatches, mismatches[:3]
    assert counts["refused"] == len(BAD) * (ROUNDS + 1)
    assert not tracebacks, tracebacks
    for name, before in memory.items():  # flat: no more than 10% + 40 MiB above the warmed-up size
        assert after[name] <= before * 1.1 + 40 * 1024, (name, before, after[name])
