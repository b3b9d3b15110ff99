"""``python -m bench.batch``: the chat workload's latency with and without a large batch running.

Starts ``llmpool serve`` (or uses ``--url``), then for each level: the chat workload alone, then a
batch of ``--batch`` chat requests (``--batch-output-len`` tokens each) created through
``/v1/batches`` and, once its requests run, the same chat workload again beside it; ``--rounds``
repeats that, in turn in the other order. Reports TTFT and ITL p50/p99 of every run and their
medians over rounds, the batch's progress during the loaded run (requests done per second
beside interactive traffic) and on its own afterwards, to ``--out`` (JSON) and stdout.

    python -m bench.batch --batch 2000 --levels 8,32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import time
from pathlib import Path

import httpx
import msgspec

from bench import servers, workloads
from bench.load import run_level
from bench.stats import summarize

KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_throughput")


def batch_file(model: str, count: int, output_len: int) -> bytes:
    lines = []
    for i in range(count):
        prompt = workloads.PROMPTS[i % len(workloads.PROMPTS)]
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": output_len}
        lines.append(
            {"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": body | {"ignore_eos": True}}
        )
    return b"\n".join(msgspec.json.encode(line) for line in lines)


def start_batch(url: str, model: str, count: int, output_len: int) -> str:
    content = batch_file(model, count, output_len)
    made = httpx.post(url + "/v1/files", files={"file": ("b.jsonl", io.BytesIO(content))}, data={"purpose": "batch"})
    made.raise_for_status()
    body = {"input_file_id": made.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = httpx.post(url + "/v1/batches", json=body, timeout=30)
    batch.raise_for_status()
    return batch.json()["id"]


def batch_state(url: str, batch_id: str) -> dict:
    return httpx.get(f"{url}/v1/batches/{batch_id}", timeout=30).json()


def chat_level(url: str, model: str, level: int, requests: int, output_len: int) -> dict:
    prompts = [workloads.PROMPTS[i % len(workloads.PROMPTS)] for i in range(requests)]
    timings, wall = asyncio.run(run_level(url, model, prompts, level, requests, output_len))
    row = summarize(level, timings, wall)
    return {key: row.get(key) for key in (*KEYS, "errors", "completed", "duration")}


def wait_ended(url: str, batch_id: str) -> dict:
    while (state := batch_state(url, batch_id))["status"] not in ("cancelled", "completed", "failed", "expired"):
        time.sleep(0.5)
    return state


def beside_batch(url: str, args: argparse.Namespace, level: int, requests: int, finish: bool) -> tuple[dict, dict]:
    """The chat workload beside a fresh ``--batch``-line batch whose requests already run; the
    batch is then cancelled, or with ``finish`` left to run to its end alone."""
    batch_id = start_batch(url, args.model, args.batch, args.batch_output_len)
    while batch_state(url, batch_id)["request_counts"]["completed"] < 1:
        time.sleep(0.2)
    before, started = batch_state(url, batch_id)["request_counts"]["completed"], time.monotonic()
    loaded = chat_level(url, args.model, level, requests, args.output_len)
    during_s, chat_done = time.monotonic() - started, time.time()
    during = batch_state(url, batch_id)["request_counts"]["completed"] - before
    loaded["batch_requests_per_s_beside"] = round(during / during_s, 2)
    if not finish:
        httpx.post(f"{url}/v1/batches/{batch_id}/cancel", timeout=30)  # the rest would only take time
    state = wait_ended(url, batch_id)
    if not finish or state["status"] != "completed":
        return loaded, {}
    after = state["request_counts"]["completed"] - before - during
    return loaded, {
        "status": state["status"],
        "request_counts": state["request_counts"],
        "created_to_completed_s": state["completed_at"] - state["created_at"],
        "requests_per_s_after_chat": round(after / (state["completed_at"] - chat_done), 2),
    }


def medians(runs: list[dict]) -> dict:
    return {key: round(statistics.median(run[key] for run in runs), 2) for key in KEYS}


def parse_args() -> argparse.Namespace:
    """The flags; what is left after ``--`` goes to `llmpool serve`."""
    parser = argparse.ArgumentParser(prog="python -m bench.batch", description=__doc__)
    parser.add_argument("--url", help="an already running llmpool (default: start `llmpool serve`)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--levels", default="8,32")
    parser.add_argument("--num-prompts", type=int, default=4, help="chat requests per stream at each level")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2000, help="requests in the batch")
    parser.add_argument("--batch-output-len", type=int, default=32)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each level, alone and beside a batch; even rounds run beside the batch first, "
        "so neither side always has the warmer machine; medians over rounds are reported",
    )
    parser.add_argument(
        "--finish",
        action="store_true",
        help="let the last run's batch go on to its end (not cancelled): its wall time and counts",
    )
    parser.add_argument("--out", default="docs/bench/batch.json")
    parser.add_argument("serve_args", nargs="*", help="more flags for `llmpool serve` (after --)")
    return parser.parse_args()


def level_rounds(url: str, args: argparse.Namespace, level: int, last: bool) -> tuple[list, list, dict]:
    """``--rounds`` runs of one level alone and beside a batch, the order turning round by round so
    neither side always has the warmer machine; with ``--finish``, the ``last`` level's last round
    lets its batch run to the end (what that batch did comes back, else an empty dict)."""
    requests = level * args.num_prompts
    alone, loaded, finished = [], [], {}
    for round_ in range(args.rounds):
        finish = args.finish and last and round_ == args.rounds - 1
        if round_ % 2:
            loaded.append(beside_batch(url, args, level, requests, False)[0])
            alone.append(chat_level(url, args.model, level, requests, args.output_len))
        else:
            alone.append(chat_level(url, args.model, level, requests, args.output_len))
            run, done = beside_batch(url, args, level, requests, finish)
            loaded.append(run)
            if done:
                finished = done
                print("finished:", json.dumps(finished), flush=True)
        print(json.dumps({"concurrency": level, "round": round_, "alone": alone[-1], "with_batch": loaded[-1]}))
    return alone, loaded, finished


def level_row(level: int, alone: list[dict], loaded: list[dict]) -> dict:
    """One level's medians over rounds and what the batch does to them, every run kept beside."""
    typical = {"alone": medians(alone), "with_batch": medians(loaded)}
    return {
        "concurrency": level,
        "median_of_rounds": typical,
        "with_over_alone": {key: round(typical["with_batch"][key] / typical["alone"][key], 3) for key in KEYS},
        "batch_requests_per_s_beside": statistics.median(r["batch_requests_per_s_beside"] for r in loaded),
        "alone": alone,
        "with_batch": loaded,
    }


def batch_alone(url: str, args: argparse.Namespace) -> float:
    """Requests/s of a batch (at most 256 lines) with nothing beside it: how fast it runs on the whole pool."""
    batch_id = start_batch(url, args.model, min(args.batch, 256), args.batch_output_len)
    started = time.monotonic()
    while (state := batch_state(url, batch_id))["status"] != "completed":
        time.sleep(0.5)
    return round(state["request_counts"]["completed"] / (time.monotonic() - started), 2)


def main() -> None:
    """Every level's rounds, then the batch alone; the servers this started are stopped whatever happens."""
    args = parse_args()
    processes, url = ([], args.url) if args.url else servers.start_llmpool(1, args.serve_args, False)
    results: dict = {
        "levels": [],
        "batch": args.batch,
        "batch_output_len": args.batch_output_len,
        "rounds": args.rounds,
        "serve": args.serve_args,
    }
    try:
        chat_level(url, args.model, 2, 2, 8)  # warm-up
        levels = list(map(int, args.levels.split(",")))
        for level in levels:
            alone, loaded, finished = level_rounds(url, args, level, level == levels[-1])
            if finished:
                results["finished"] = finished
            row = level_row(level, alone, loaded)
            results["levels"].append(row)
            print(json.dumps({k: row[k] for k in ("concurrency", "median_of_rounds", "with_over_alone")}), flush=True)
        results["batch_alone_requests_per_s"] = batch_alone(url, args)
        print("batch alone:", results["batch_alone_requests_per_s"], "requests/s", flush=True)
    finally:
        servers.stop(processes)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
