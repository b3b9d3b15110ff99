"""What the state store costs: 64 streams of the chat and Responses workloads against servers with
no store (the code before it: ``--baseline-tree``), a SQLite store and a PostgreSQL store (a real
server, fsync on), the configurations alternating round by round on the same machine.

    python -m bench.state_cost --baseline-tree /tmp/llmpool-before --rounds 3
    python -m bench.state_cost --baseline-tree /tmp/llmpool-before --fake-worker   # the gateway alone
    python -m bench.state_cost --rounds 3   # no store = this tree's Responses with `store: false`

Without ``--baseline-tree``, "no store" is this code on SQLite with Responses sent ``store: false``
(nothing written for them): with a real model that keeps every other difference between the trees,
the worker's above all, out of the comparison; chat streams are sent ``store: false`` there too, and
are logged (events and token chunks, to resume on another gateway) in the stored configurations.

Per run: output tokens/s, TTFT p50, the gap between a Responses stream's last delta and its
``response.completed`` (where the final row is committed: the write the client waits for, after the
tokens), and the CPU time the gateway process (and the PostgreSQL server) spent per output token,
which a loaded machine disturbs far less than tokens/s. ``--fake-worker`` puts a model-less worker
(bench/fake_worker.py) behind each gateway, so the gateway's own cost is all there is to measure.
Results go to bench-results/state-cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import orjson

from bench.load import _read_chunked
from bench.prompts import PROMPTS

MODEL = "SmolLM2-135M-Instruct"


def body(workload: str, prompt: str, tokens: int, store: bool) -> tuple[bytes, bytes]:
    if workload == "chat":
        payload = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "stream": True,
            "store": store,  # a chat stream is logged (it can resume on another gateway) unless store: false
        }
        payload |= {"stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.8}
        return b"/v1/chat/completions", orjson.dumps(payload)
    payload = {
        "model": MODEL,
        "input": prompt,
        "max_output_tokens": tokens,
        "stream": True,
        "store": store,
        "ignore_eos": True,
        "temperature": 0.8,
    }
    return b"/v1/responses", orjson.dumps(payload)


async def one(port: int, path: bytes, data: bytes) -> dict:
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (path, len(data), data)
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    first = last_delta = None
    tokens, end_gap, pending = 0, None, b""
    async for chunk in _read_chunked(reader):
        pending += chunk
        *events, pending = pending.split(b"\n\n")
        for event in events:
            now = time.perf_counter()
            event = event.split(b"\n", 1)[1] if event.startswith(b"id: ") else event
            if b'"delta":{"content":"' in event or b"response.output_text.delta" in event[:40]:
                first = first or now
                last_delta = now
            elif b'"usage":{"prompt_tokens"' in event:
                tokens = orjson.loads(event.split(b"data: ", 1)[1])["usage"]["completion_tokens"]
            elif event.startswith(b"event: response.completed") or event.startswith(b"event: response.incomplete"):
                tokens = orjson.loads(event.split(b"data: ", 1)[1])["response"]["usage"]["output_tokens"]
                end_gap = now - (last_delta or now)
    writer.close()
    return {"ttft": (first or time.perf_counter()) - start, "tokens": tokens, "end_gap": end_gap}


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


async def level(
    port: int, workload: str, streams: int, requests: int, tokens: int, store: bool, gateway: int, postmaster: int
) -> dict:
    queue = list(range(requests))
    results: list[dict] = []

    async def client() -> None:
        while queue:
            n = queue.pop()
            path, data = body(workload, PROMPTS[n % len(PROMPTS)], tokens, store)
            results.append(await one(port, path, data))

    database = children(postmaster)
    gateway_cpu, database_cpu = cpu_s([gateway]), cpu_s(database)
    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall = time.perf_counter() - began
    produced = sum(r["tokens"] for r in results)
    gaps = [r["end_gap"] for r in results if r["end_gap"] is not None]
    return {
        "output_tok_s": produced / wall,
        "gateway_cpu_us_per_token": 1e6 * (cpu_s([gateway]) - gateway_cpu) / produced,
        "postgres_cpu_us_per_token": 1e6 * (cpu_s(database) - database_cpu) / produced,
        "ttft_p50_ms": 1000 * statistics.median(r["ttft"] for r in results),
        "end_gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
        "end_gap_p99_ms": 1000 * sorted(gaps)[int(0.99 * (len(gaps) - 1))] if gaps else None,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        help="a checkout of the code before the store (git archive d574bd2); default: this tree, `store: false`",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", default="chat,responses", help="comma-separated: chat, responses")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--fake-worker", action="store_true", help="a model-less worker behind each gateway: the gateway's cost alone"
    )
    parser.add_argument("--step-ms", type=float, default=10.0, help="--fake-worker: its step time")
    parser.add_argument("--out", type=Path, default=Path("bench-results/state-cost.json"))
    return parser.parse_args()


def main() -> None:
    """Start every configuration's server, run the rounds, stop them all (whatever happens), then
    write and print the medians."""
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped run still stops its servers

    from tests.conftest import ARTIFACTS, stop
    from tests.postgres import Postgres

    postgres = Postgres(durable=True)
    configs = configurations(args.baseline_tree, postgres)
    postmaster = int((postgres.data / "postmaster.pid").read_text().split()[0])
    ARTIFACTS.mkdir(exist_ok=True)
    processes: list[subprocess.Popen] = []
    try:
        ports, gateways = start_servers(configs, args, processes)
        wait_ready(ports, gateways, args.fake_worker)
        runs = run_rounds(configs, args, ports, gateways, postmaster)
    finally:
        for process in processes:
            stop(process, 30)
        postgres.stop()
    write_summary(runs, args.out)


def configurations(baseline_tree: Path | None, postgres) -> dict[str, tuple[Path, str | None, bool]]:
    """Each configuration's tree, state URL and whether its requests ask to be stored. "none" is the
    baseline tree with no store, or without one this tree on SQLite with nothing stored."""
    from tests.conftest import REPO

    return {
        "none": (baseline_tree, None, False)
        if baseline_tree
        else (REPO, f"sqlite:///{postgres.folder}/bench-none.db", False),
        "sqlite": (REPO, f"sqlite:///{postgres.folder}/bench-state.db", True),
        "postgresql": (REPO, postgres.database("bench"), True),
    }


def _start(command: list[str], cwd: Path, env: dict[str, str], name: str, processes: list) -> subprocess.Popen:
    """``python -m COMMAND`` from ``cwd`` (its tree first on sys.path), logged to the test artifacts;
    added to ``processes`` at once so it is stopped whatever happens next."""
    from tests.conftest import ARTIFACTS

    log = open(ARTIFACTS / f"state-cost-{name}.log", "ab")
    process = subprocess.Popen([sys.executable, "-m", *command], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    processes.append(process)
    return process


def start_servers(configs: dict, args: argparse.Namespace, processes: list) -> tuple[dict[str, int], dict[str, int]]:
    """Each configuration's server: a gateway and a fake worker (``--fake-worker``), else `llmpool serve`
    with one worker. Returns their HTTP ports and the pids whose CPU is measured (the launcher's
    pid for now: ``wait_ready`` puts its gateway child's in its place)."""
    from tests.conftest import REPO, free_port

    ports, gateways = {}, {}
    for name, (tree, url, _) in configs.items():
        port, zmq = free_port(), free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"LLMPOOL_STATE_URL": url} if url else {})}
        address = ["--port", str(port), "--zmq-bind", f"tcp://127.0.0.1:{zmq}"]
        if args.fake_worker:
            gateways[name] = _start(["gateway", *address], tree, env, name, processes).pid
            worker = [
                "bench.fake_worker",
                "--gateway-address",
                f"tcp://127.0.0.1:{zmq}",
                "--step-ms",
                str(args.step_ms),
            ]
            _start(worker, REPO, env, f"{name}-worker", processes)
        else:
            serve = ["launcher", "serve", *address, "--workers", "1"]
            gateways[name] = _start(serve, tree, env, name, processes).pid
        ports[name] = port
    return ports, gateways


def wait_ready(ports: dict[str, int], gateways: dict[str, int], fake_worker: bool) -> None:
    """Every server answers /ready; a launcher's pid is replaced by its gateway child's, the process
    whose CPU the store adds to."""
    import httpx

    from tests.conftest import wait_until

    for name, port in ports.items():
        wait_until(
            lambda port=port: httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code == 200,
            600,
            f"{name} ready",
        )
        if not fake_worker:  # the launcher's gateway child
            (gateways[name],) = [
                pid for pid in children(gateways[name]) if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes()
            ]


def run_rounds(
    configs: dict, args: argparse.Namespace, ports: dict[str, int], gateways: dict[str, int], postmaster: int
) -> dict[str, list[dict]]:
    """``--rounds`` rounds, each running every configuration and workload in turn, so they all see
    the machine in the same states; runs by "configuration/workload"."""
    workloads = args.workloads.split(",")
    runs: dict[str, list[dict]] = {f"{n}/{w}": [] for n in configs for w in workloads}
    for round_ in range(args.rounds):
        for name, (_, _, store) in configs.items():
            for workload in workloads:
                result = asyncio.run(
                    level(
                        ports[name],
                        workload,
                        args.streams,
                        args.requests,
                        args.tokens,
                        store,
                        gateways[name],
                        postmaster,
                    )
                )
                runs[f"{name}/{workload}"].append(result)
                print(f"round {round_ + 1} {name:10s} {workload:9s} {json.dumps(result)}", flush=True)
    return runs


def write_summary(runs: dict[str, list[dict]], out: Path) -> None:
    """Medians over rounds beside every run, to ``out``; the medians printed, one line a run kind."""
    medians = ("output_tok_s", "gateway_cpu_us_per_token", "postgres_cpu_us_per_token")
    summary = {
        key: {**{f"{m}_median": statistics.median(r[m] for r in rs) for m in medians}, "runs": rs}
        for key, rs in runs.items()
    }
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    for key, value in summary.items():
        figures = " ".join(f"{m} {value[m + '_median']:8.1f}" for m in medians)
        print(f"{key:22s} {figures}")


if __name__ == "__main__":
    main()
