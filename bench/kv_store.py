"""``python -m bench.kv_store``: what the KV store (``--kv-store``) buys, and what it costs.

``--workload long-context`` or ``agent`` (bench/workloads.py): each round takes fresh prompts and
measures TTFT in four cases, one after another, so every round gives same-run ratios:

- ``recompute``: worker A (gateway 1), cold RAM and cold store: the prefill runs (and is written);
- ``warm RAM``: the same prompts (agent: new turns) again on A: its prefix cache serves them;
- ``second worker``: worker B (its own gateway 2, alive beside A, sharing the store folder);
- ``restart``: A stopped (SIGTERM) and started again: cold RAM, warm store (after one long request
  from the store, as B had: a new process's first long-context steps are slow whatever they compute).

Per case: TTFT p50 over the round's requests; across rounds, the median of those and of each
round's ratio to ``recompute``. The store's read speed comes from the workers' heartbeats
(``kv_store_read_bytes / kv_store_read_seconds``), beside the prefill's own speed.

``--workload chat``: the store's cost when it is on and cold: ``llmpool serve`` with a fresh
``--kv-store`` folder and without one, alternating (order swapped every round), bench's chat
workload at ``--concurrency`` levels; medians of throughput and TTFT and their ratios.

The machine's load average is printed with every round: on a shared machine, read ratios, not
absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import servers, workloads
from bench.load import run_level
from bench.stats import percentile, summarize

MODEL = "SmolLM2-135M-Instruct"
CASES = ("recompute", "warm RAM", "second worker", "restart")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kv_store", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=("long-context", "agent", "chat"), default="long-context")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2, help="requests per case and round")
    parser.add_argument(
        "--input-len", type=int, help="long-context: prompt tokens (4096); agent: system prompt tokens (4000)"
    )
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--concurrency", default="1,8", help="chat: levels")
    parser.add_argument("--worker-arg", action="append", default=[], help="extra flag for the workers (repeatable)")
    parser.add_argument("--out", default="bench-results")
    return parser.parse_args()


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def ttfts(url: str, prompts: list[str], output_len: int, system: str | None = None) -> list[float]:
    timings, _ = asyncio.run(run_level(url, MODEL, prompts, 1, len(prompts), output_len, system))
    errors = [t.error for t in timings if t.error]
    if errors:
        raise SystemExit(f"{url}: {errors[0]}")
    return [t.ttft for t in timings]


class Pair:
    """A gateway and one worker of its own, as processes; the worker can be restarted."""

    def __init__(self, name: str, store: Path, worker_args: list[str]) -> None:
        self.name, self.store, self.worker_args = name, store, worker_args
        self.port, self.zmq = servers.free_port(), f"tcp://127.0.0.1:{servers.free_port()}"
        self.url = f"http://127.0.0.1:{self.port}"
        # A 4,096-token prefill takes 7 s on 2 quiet cores, a minute on a busy machine: past the default hung-worker check.
        self.gateway = self._spawn(
            [
                "gateway",
                "--port",
                str(self.port),
                "--zmq-bind",
                self.zmq,
                "--hung-timeout",
                "600",
                "--request-timeout",
                "1800",
            ]
        )
        self.worker = self.start_worker()

    def _spawn(self, args: list[str]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start_worker(self) -> subprocess.Popen:
        args = [
            "worker",
            "--gateway-address",
            self.zmq,
            "--worker-name",
            self.name,
            "--kv-store",
            str(self.store),
            *self.worker_args,
        ]
        self.worker = self._spawn(args)
        servers.wait_ready(self.url, "/workers", [self.gateway, self.worker], lambda r: len(r.json()["workers"]) == 1)
        return self.worker

    def restart_worker(self) -> None:
        servers.stop([self.worker])
        servers.wait_ready(self.url, "/workers", [self.gateway], lambda r: not r.json()["workers"])
        self.start_worker()

    def figures(self) -> dict:
        (worker,) = httpx.get(self.url + "/workers", timeout=10).json()["workers"]
        return worker

    def stop(self) -> None:
        servers.stop([self.worker, self.gateway])


def store_rounds(args: argparse.Namespace) -> dict:
    from common.config import CACHE_DIR
    from common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(MODEL), CACHE_DIR.env_default())
    folder = Path(tempfile.mkdtemp(prefix="kv-store-bench-"))
    a, b = Pair("a", folder, args.worker_arg), Pair("b", folder, args.worker_arg)
    agent = args.workload == "agent"
    rounds = []
    try:
        # Warm-up: a new process's first steps at a long context are slow whatever they compute
        # (2.1 and 1.8 s for the 16 tokens after 4,080 loaded ones, then 0.5 s, in one run): one
        # long request first, computed by A, read from the store by B (and by A after each restart).
        warm = workloads.build(args.workload, [1], 1, 4, args.input_len, tokenizer, seed=999)
        for pair in (a, b):
            ttfts(pair.url, warm.levels[1], 4, warm.system)
            time.sleep(1.0)
        for r in range(args.rounds):
            # Fresh prompts every round (agent: a fresh system prompt and turns): nothing cached yet.
            work = workloads.build(
                args.workload, [1], 5 * args.requests, args.output_len, args.input_len, tokenizer, seed=1000 + r
            )
            prompts, system = work.levels[1], work.system
            batches = (
                [prompts[: args.requests]] * 4
                if not agent
                else [prompts[i * args.requests : (i + 1) * args.requests] for i in range(1, 5)]
            )
            started = load()
            found = {}
            if agent:
                found["recompute"] = ttfts(
                    a.url, prompts[: args.requests][:1], args.output_len, system
                )  # the first turn computes it
            else:
                found["recompute"] = ttfts(a.url, batches[0], args.output_len, system)
            time.sleep(1.0)  # the writes behind the prefill end (they run on the worker's writer thread)
            found["warm RAM"] = ttfts(a.url, batches[1], args.output_len, system)
            before_b = b.figures()
            found["second worker"] = ttfts(b.url, batches[2], args.output_len, system)
            a.restart_worker()
            ttfts(a.url, warm.levels[1], 4, warm.system)  # as B was warmed (from the store)
            found["restart"] = ttfts(a.url, batches[3], args.output_len, system)
            time.sleep(1.5)  # the heartbeat after the requests
            read = [_read_speed(before_b, b.figures()), _read_speed({}, a.figures())]
            row = {"round": r, "load_before": started, "load_after": load(), "read_mb_per_s": read}
            row |= {case: round(percentile(times, 50) * 1000, 1) for case, times in found.items()}
            row["ttfts_ms"] = {case: [round(t * 1000) for t in times] for case, times in found.items()}
            row["prompt_tokens"] = len(tokenizer.encode(system or "")) if agent else work.input_len
            print(json.dumps(row), flush=True)
            rounds.append(row)
    finally:
        a.stop()
        b.stop()
        shutil.rmtree(folder, ignore_errors=True)
    return summarize_rounds(rounds)


def _read_speed(before: dict, after: dict) -> float | None:
    seconds = after["kv_store_read_seconds"] - before.get("kv_store_read_seconds", 0.0)
    read = after["kv_store_read_bytes"] - before.get("kv_store_read_bytes", 0)
    return round(read / seconds / 1e6, 1) if seconds > 0 else None


def summarize_rounds(rounds: list[dict]) -> dict:
    summary = {"rounds": rounds}
    for case in CASES:
        summary[f"{case} ttft p50 ms"] = round(statistics.median(r[case] for r in rounds), 1)
        summary[f"{case} / recompute"] = round(statistics.median(r[case] / r["recompute"] for r in rounds), 4)
    speeds = [s for r in rounds for s in r["read_mb_per_s"] if s]
    summary["store read MB/s (median)"] = round(statistics.median(speeds), 1) if speeds else None
    return summary


def chat_rounds(args: argparse.Namespace) -> dict:
    """The store on and cold (a fresh folder each time) against no store, alternating."""
    levels = [int(c) for c in args.concurrency.split(",")]
    work = workloads.build("chat", levels, None, args.output_len, None)
    rows: list[dict] = []
    for r in range(args.rounds):
        order = ("off", "on") if r % 2 == 0 else ("on", "off")
        for setting in order:
            folder = tempfile.mkdtemp(prefix="kv-store-chat-")
            extra = [*args.worker_arg] + (["--kv-store", folder] if setting == "on" else [])
            processes, url = servers.start_llmpool(1, extra, False)
            try:
                ttfts(url, ["Hello there"], 4)
                for level in levels:
                    started = load()
                    timings, wall = asyncio.run(
                        run_level(url, MODEL, work.levels[level], level, len(work.levels[level]), args.output_len)
                    )
                    row = summarize(level, timings, wall) | {"store": setting, "round": r, "load": started}
                    print(
                        json.dumps(
                            {
                                k: row[k]
                                for k in (
                                    "round",
                                    "store",
                                    "concurrency",
                                    "output_throughput",
                                    "median_ttft_ms",
                                    "median_tpot_ms",
                                    "load",
                                )
                            }
                        )
                    )
                    rows.append(row)
            finally:
                servers.stop(processes)
                shutil.rmtree(folder, ignore_errors=True)
    summary: dict = {"rows": rows}
    for level in levels:
        for metric in ("output_throughput", "median_ttft_ms", "median_tpot_ms"):
            pairs = [
                (on[metric], off[metric])
                for on in rows
                for off in rows
                if on["store"] == "on"
                and off["store"] == "off"
                and on["round"] == off["round"]
                and on["concurrency"] == off["concurrency"] == level
            ]
            summary[f"c{level} {metric} on / off (median of rounds)"] = round(
                statistics.median(x / y for x, y in pairs), 3
            )
    return summary


def main() -> None:
    args = parse_args()
    summary = chat_rounds(args) if args.workload == "chat" else store_rounds(args)
    summary["workload"] = args.workload
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kv-store-{args.workload}.json"
    path.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rounds", "rows")}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
