"""``python -m bench``: output tokens/s, TTFT, inter-token and end-to-end latency of the streaming
chat API at several concurrency levels; ``--baseline`` adds transformers' ``generate`` (one request
at a time, same prompts, same run) and prints the ratios. Results go to ``--out`` as JSON.

``--gateway-overhead`` measures the gateway alone: the real gateway with a worker that has no
model (bench/fake_worker.py), so tokens/s is what the HTTP side can carry and the single-stream
inter-token latency is what the gateway adds per token.

Examples:
    python -m bench                                   # start `llmpool serve`, levels 1 8 32 64
    python -m bench --concurrency 1,16 --baseline
    python -m bench --url http://127.0.0.1:8000       # an already running server
    python -m bench --gateway-overhead                # levels 1 and 256 against a model-less worker
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

try:
    import uvloop
except ImportError:  # the plain event loop works too, with a slower client
    uvloop = None

from bench.load import run_level
from bench.plot import plot
from bench.prompts import PROMPTS
from bench.stats import summarize

COLUMNS = ["concurrency", "requests", "errors", "tokens_per_s", "per_stream_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "e2e_p50_s"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(workers: int, extra: list[str], fake_worker: bool, fake_step_ms: float = 0.0) -> tuple[list[subprocess.Popen], str]:
    """`llmpool serve`, or (fake_worker) the gateway plus the model-less worker."""
    port, zmq_port = _free_port(), _free_port()
    zmq = f"tcp://127.0.0.1:{zmq_port}"
    if fake_worker:
        commands = [[sys.executable, "-m", "gateway", "--port", str(port), "--zmq-bind", zmq, *extra],
                    [sys.executable, "-m", "bench.fake_worker", "--gateway-address", zmq, "--step-ms", str(fake_step_ms)]]
    else:
        commands = [[sys.executable, "-m", "launcher", "serve", "--workers", str(workers), "--port", str(port), "--zmq-bind", zmq, *extra]]
    processes = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if len(httpx.get(url + "/workers", timeout=2).json()["workers"]) == (1 if fake_worker else workers):
                return processes, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    for process in processes:
        process.kill()
    raise SystemExit("the server did not become ready")


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>12}" for c in COLUMNS))
    for row in rows:
        print("  ".join(f"{row[c]!s:>12}" for c in COLUMNS))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="benchmark this running server instead of starting one")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--concurrency", default=None, help="comma-separated levels (default 1,8,32,64; 1,256 with --gateway-overhead)")
    parser.add_argument("--gateway-overhead", action="store_true", help="the gateway alone, with a worker that has no model")
    parser.add_argument("--fake-step-ms", type=float, default=0.0, help="with --gateway-overhead: the model-less worker's step time")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=1, help="workers of the server this starts")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for `llmpool serve` (repeatable)")
    parser.add_argument("--baseline", action="store_true", help="also run transformers' generate, one request at a time")
    parser.add_argument("--out", default="bench-results", help="folder for results.json")
    args = parser.parse_args()
    levels = [int(c) for c in (args.concurrency or ("1,256" if args.gateway_overhead else "1,8,32,64")).split(",")]

    results: dict = {"mode": "gateway-overhead" if args.gateway_overhead else "model", "fake_step_ms": args.fake_step_ms, "model": args.model, "max_tokens": args.max_tokens, "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}}
    if args.baseline:
        from bench.baseline import run_baseline

        timings, wall = run_baseline(args.model, PROMPTS, max(4, args.rounds * 2), args.max_tokens)
        results["baseline"] = summarize(1, timings, wall)
        print_table("baseline: transformers generate, one request at a time", [results["baseline"]])

    processes: list[subprocess.Popen] = []
    url = args.url
    if url is None:
        processes, url = start_server(args.workers, [a for extra in args.server_arg for a in extra.split()], args.gateway_overhead, args.fake_step_ms)
    try:
        run = uvloop.run if uvloop is not None else asyncio.run
        run(run_level(url, args.model, PROMPTS, 2, 2, 8))  # warm-up
        rows = []
        for level in levels:
            timings, wall = run(run_level(url, args.model, PROMPTS, level, level * args.rounds, args.max_tokens))
            rows.append(summarize(level, timings, wall))
            print(f"concurrency {level}: {rows[-1]['tokens_per_s']} tokens/s", flush=True)
        results["levels"] = rows
        results["workers"] = httpx.get(url + "/workers", timeout=5).json()["workers"]
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            process.wait(timeout=30)
    title = "gateway alone (model-less worker)" if args.gateway_overhead else "llmpool"
    print_table(f"{title} via HTTP streaming ({args.max_tokens} tokens per request)", rows)
    if args.baseline:
        base = results["baseline"]["tokens_per_s"]
        results["ratios_vs_baseline"] = {r["concurrency"]: round(r["tokens_per_s"] / base, 2) for r in rows}
        print("\ntokens/s vs baseline: " + ", ".join(f"{c}: {x}x" for c, x in results["ratios_vs_baseline"].items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out / 'results.json'}")
    if plot(results, out / "bench.png"):
        print(f"wrote {out / 'bench.png'}")


if __name__ == "__main__":
    main()
