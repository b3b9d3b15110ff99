"""``python -m bench``: the streaming chat API under a workload at several concurrency levels,
reported with ``vllm bench serve``'s metrics (request, output and total token throughput; TTFT,
TPOT, ITL and E2EL mean, median and p99).

Workloads (bench/workloads.py): ``chat`` (short chat prompts, 128 tokens out), ``random`` (unique
prompts of ``--input-len`` tokens, ``--output-len`` out: vLLM's default shape) and ``long-context``
(one stream at a ``--input-len`` context), ``agent`` (one fixed ~4,000-token system prompt with tool
definitions, a short user turn varying). Every request sets ``ignore_eos``, so every server
generates exactly ``--output-len`` tokens.

``--peer [LABEL=]URL`` (repeatable) runs the same prompts against another OpenAI-compatible server
in the same run, level by level right after ours, and prints the ratios; ``--start-llama-server
PATH`` starts llama.cpp's llama-server on the same GGUF as that peer (bench/build_llama_server.sh
builds it). ``--baseline`` adds transformers' ``generate`` (one request at a time). Results go to
``--out``. ``--gateway-overhead`` measures the gateway alone, with a worker that has no model
(bench/fake_worker.py): tokens/s is what the HTTP side can carry. With ``--fake-workers N[,N...]`` it
measures the gateway at scale instead (bench/fleet.py): N simulated workers in ``--fleet-processes``
processes, each registered with two gateways; per N the routing cost per request (in-process), the
gateway's CPU for heartbeats alone, and requests/s of short requests through one gateway.

Examples:
    python -m bench                                   # chat, levels 1 8 32 64
    python -m bench --workload random --input-len 1024 --output-len 128 --start-llama-server .llama.cpp/build/bin/llama-server
    python -m bench --workload long-context --input-len 4096 --peer llama.cpp=http://127.0.0.1:8081
    python -m bench --url http://127.0.0.1:8000       # an already running server
    python -m bench --gateway-overhead                # levels 1 and 256 against a model-less worker
    python -m bench --gateway-overhead --fake-workers 16,64,256,1024   # the gateway at scale, simulated
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx

try:
    import uvloop
except ImportError:  # the plain event loop works too, with a slower client
    uvloop = None

from bench import servers, workloads
from bench.load import run_level
from bench.plot import plot
from bench.report import ratios, table
from bench.stats import summarize

# ``parser.add_argument``, handed to each group of flags below
AddFlag = Callable[..., argparse.Action]


def parse_args() -> argparse.Namespace:
    """The flags, group by group; ``--help`` lists them in the order they are added here."""
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for group in (_workload_flags, _peer_flags, _fleet_flags, _server_flags, _output_flags):
        group(parser.add_argument)
    return parser.parse_args()


def _workload_flags(add: AddFlag) -> None:
    """What is sent: the workload's shape, the concurrency levels and how many requests each."""
    add("--workload", choices=workloads.WORKLOADS, default="chat")
    add(
        "--input-len",
        type=int,
        help="random / long-context: prompt tokens, chat template included (1024 / 4096); agent: the system prompt's (4000)",
    )
    add("--output-len", "--max-tokens", type=int, default=128, help="tokens generated per request")
    add("--concurrency", help="comma-separated levels (chat 1,8,32,64; random 1,8,32; long-context 1; gateway 1,256)")
    add("--num-prompts", type=int, help="requests per level (default max(4, 2 x concurrency))")
    add("--seed", type=int, default=0, help="random prompts' seed")


def _peer_flags(add: AddFlag) -> None:
    """Which servers are measured: ours (or a running one), the peers compared with it, the model."""
    add("--url", help="benchmark this running server instead of starting one")
    add("--label", default="llmpool", help="our server's name in the table")
    add("--peer", action="append", default=[], help="[LABEL=]URL of another OpenAI-compatible server (repeatable)")
    add("--start-llama-server", metavar="PATH", help="start this llama-server binary on the model's GGUF as a peer")
    add("--llama-server-arg", action="append", default=[], help="extra flag for llama-server (repeatable)")
    add("--peer-threads", type=int, default=2, help="llama-server's -t")
    add("--model", default="SmolLM2-135M-Instruct")


def _fleet_flags(add: AddFlag) -> None:
    """The gateway alone (``--gateway-overhead``) and at scale with simulated workers (bench/fleet.py)."""
    add("--gateway-overhead", action="store_true", help="the gateway alone, with a worker that has no model")
    add("--fake-step-ms", type=float, default=0.0, help="with --gateway-overhead: the model-less worker's step time")
    add(
        "--fake-workers",
        help="with --gateway-overhead: comma-separated fleet sizes (bench/fleet.py), e.g. 16,64,256,1024",
    )
    add("--fleet-processes", type=int, default=4, help="processes the simulated workers are spread over")
    add("--fleet-levels", default="64,256", help="concurrency levels of the fleet's requests/s runs")
    add("--fleet-requests", type=int, default=2000, help="requests per fleet level")
    add("--routing-requests", type=int, default=20000, help="requests of the in-process routing measurement")
    add("--routing-only", action="store_true", help="the fleet run's in-process routing measurement alone")
    add("--cpu-window", type=float, default=10.0, help="seconds over which the idle gateways' CPU is read")
    add("--heartbeat-interval", type=float, default=1.0, help="fleet: gateways' and workers' heartbeat interval")


def _server_flags(add: AddFlag) -> None:
    """The server this starts (without ``--url``): how many workers, and any `llmpool serve` flag the
    other groups do not name."""
    add("--workers", type=int, default=1, help="workers of the server this starts")
    add("--server-arg", action="append", default=[], help="extra flag for `llmpool serve` (repeatable)")


def _output_flags(add: AddFlag) -> None:
    """The transformers baseline, off by default (it is slow), and where results go."""
    add("--baseline", action="store_true", help="also run transformers' generate, one request at a time")
    add("--out", default="bench-results", help="folder for results-MODE.json and bench-MODE.png")


def main() -> None:
    """Each step a function of its own, in the order a run takes: the prompts, the baseline (alone
    on the machine), the servers, the report."""
    args = parse_args()
    if args.fake_workers:
        run_fleet(args)
        return
    mode = "gateway-overhead" if args.gateway_overhead else args.workload
    levels = [int(c) for c in args.concurrency.split(",")] if args.concurrency else list(workloads.DEFAULT_LEVELS[mode])
    work = build_work(args, levels)
    out = Path(args.out)
    results = header(args, mode, work)
    if args.baseline:
        results["baseline"] = run_baseline(args, work, levels)
    results["servers"] = measure_servers(args, work, levels, out)
    report(results, args.baseline, out)


def build_work(args: argparse.Namespace, levels: list[int]) -> workloads.Workload:
    """The prompts of every level; workloads other than chat count tokens, so they load the tokenizer."""
    tokenizer = None
    if args.workload != "chat":
        from common.config import CACHE_DIR
        from common.model_source import load_tokenizer, resolve_model

        tokenizer = load_tokenizer(resolve_model(args.model), CACHE_DIR.env_default())
    return workloads.build(
        args.workload,
        levels,
        args.num_prompts,
        args.output_len,
        args.input_len,
        tokenizer,
        args.seed,
    )


def header(args: argparse.Namespace, mode: str, work: workloads.Workload) -> dict:
    """What the results were measured with, first in the JSON so a reader sees it before the figures."""
    return {
        "mode": mode,
        "workload": args.workload,
        "input_len": work.input_len,
        "output_len": work.output_len,
        "fake_step_ms": args.fake_step_ms,
        "model": args.model,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
    }


def run_baseline(args: argparse.Namespace, work: workloads.Workload, levels: list[int]) -> dict:
    """``--baseline``: transformers' generate on the first level's prompts, one request at a time;
    run before any server starts, so it has the machine to itself."""
    from bench.baseline import run_baseline as generate

    prompts = work.levels[levels[0]][: workloads.requests_per_level(1, args.num_prompts)]
    timings, wall = generate(args.model, prompts, len(prompts), work.output_len)
    row = summarize(1, timings, wall)
    print(table({"transformers generate": [row]}, {}), flush=True)
    return row


def measure_servers(args: argparse.Namespace, work: workloads.Workload, levels: list[int], out: Path) -> dict:
    """Start ours (unless ``--url``) and llama-server if asked, run every level on every server, and
    stop what was started whatever happens."""
    processes: list[subprocess.Popen] = []
    peers = [servers.parse_peer(p) for p in args.peer]
    try:
        url = args.url.rstrip("/") if args.url else None
        if url is None:
            extra = [a for flags in args.server_arg for a in flags.split()]
            if not args.gateway_overhead:  # the model measured, unless a --server-arg names another
                extra = [f"--model={args.model}", *extra]
            processes, url = servers.start_llmpool(args.workers, extra, args.gateway_overhead, args.fake_step_ms)
        measured = [servers.Server(args.label, url), *peers]
        if args.start_llama_server:
            process, peer_url = start_llama_server(args, work, max(levels), out)
            processes.append(process)
            measured.append(servers.Server("llama.cpp", peer_url))
        return run_all(measured, servers.served_name(args.model), work, levels)
    finally:
        servers.stop(processes)


def run_fleet(args: argparse.Namespace) -> None:
    """``--gateway-overhead --fake-workers N,...``: the gateway at scale (bench/fleet.py)."""
    from bench import fleet

    if not args.gateway_overhead:
        raise SystemExit("--fake-workers goes with --gateway-overhead")
    args.fake_workers = [int(n) for n in args.fake_workers.split(",")]
    args.fleet_levels = [int(n) for n in args.fleet_levels.split(",")]
    args.output_len = args.output_len if args.output_len != 128 else 8  # short requests unless told
    # Simulated workers step every 10 ms unless told: at 0 ms a fleet process with any request spins
    # on its poller and takes the CPU the gateway is being measured on.
    args.fake_step_ms = args.fake_step_ms or 10.0
    args.extra_server_args = [a for flags in args.server_arg for a in flags.split()]
    fleet.run(args, Path(args.out), Path(__file__).resolve().parent.parent)


def start_llama_server(
    args: argparse.Namespace, work: workloads.Workload, slots: int, out: Path
) -> tuple[subprocess.Popen, str]:
    """llama-server on the model's own GGUF, with room for every stream's prompt and output."""
    from common.model_source import resolve_model

    source = resolve_model(args.model)
    if source.gguf_file is None:
        raise SystemExit("--start-llama-server needs a GGUF model")
    context = slots * ((work.input_len or 256) + work.output_len)
    gguf = Path(source.path) / source.gguf_file
    command = servers.llama_server_command(
        args.start_llama_server,
        gguf,
        servers.free_port(),
        slots,
        context,
        args.peer_threads,
        args.llama_server_arg,
    )
    print("starting " + " ".join(command), flush=True)
    return servers.start_llama_server(command, out / "llama-server.log")


def warm_up(server: servers.Server, model: str, prompts: list[str], run) -> None:
    """Short requests until a round has no error: a server's first steps can be slow enough
    (compiling, on a busy machine) for its gateway to drop the worker for a moment."""
    for _ in range(10):
        timings, _ = run(run_level(server.url, model, prompts, 2, 2, 8))
        error = next((t.error for t in timings if t.error), None)
        if error is None:
            return
        time.sleep(2)
    raise SystemExit(f"{server.label} keeps failing its warm-up: {error}")


def run_all(
    measured: list[servers.Server],
    model: str,
    work: workloads.Workload,
    levels: list[int],
) -> dict[str, dict]:
    """Every level on every server, ours first then each peer, so they see the same machine state."""
    run = uvloop.run if uvloop is not None else asyncio.run
    found: dict[str, dict] = {}
    for server in measured:
        warm_up(server, model, work.warmup, run)
        found[server.label] = {"url": server.url, "levels": []} | servers.describe(server.url)
    for level in levels:
        prompts = work.levels[level]
        for server in measured:
            timings, wall = run(
                run_level(server.url, model, prompts, level, len(prompts), work.output_len, work.system)
            )
            row = summarize(level, timings, wall)
            found[server.label]["levels"].append(row)
            print(
                f"concurrency {level}, {server.label}: {row['output_throughput']} output tok/s, "
                f"TPOT median {row['median_tpot_ms']} ms, TTFT median {row['median_ttft_ms']} ms, "
                f"{row['errors']} errors {row['first_error'] or ''}",
                flush=True,
            )
            per_request = row["total_input_tokens"] / max(1, row["completed"])
            if work.input_len and row["completed"] and abs(per_request - work.input_len) > 0.01 * work.input_len:
                print(
                    f"  note: {server.label} counted {per_request:.0f} prompt tokens per request, not {work.input_len}"
                )
    try:
        workers = httpx.get(measured[0].url + "/workers", timeout=5).json()["workers"]
        found[measured[0].label]["workers"] = workers
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return found


def report(results: dict, baseline: bool, out: Path) -> None:
    """Print the table (with ratios to each peer and to the baseline); write the JSON and the plot."""
    measured = results["servers"]
    ours, *peers = measured
    results["ratios"] = {label: ratios(measured[ours]["levels"], measured[label]["levels"]) for label in peers}
    shape = f"{results['input_len']} tokens in, " if results["input_len"] else ""
    print(f"\n{results['mode']}: {shape}{results['output_len']} tokens out per request, streamed chat completions\n")
    print(
        table(
            {label: server["levels"] for label, server in measured.items()},
            results["ratios"],
        )
    )
    if baseline:
        base = results["baseline"]["output_throughput"]
        results["ratios_vs_baseline"] = {
            r["concurrency"]: round(r["output_throughput"] / base, 2) for r in measured[ours]["levels"]
        }
        print(
            "\noutput tok/s vs baseline: " + ", ".join(f"{c}: {x}x" for c, x in results["ratios_vs_baseline"].items())
        )
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"results-{results['mode']}.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {path}")
    picture = out / f"bench-{results['mode']}.png"
    if plot(results, picture):
        print(f"wrote {picture}")


if __name__ == "__main__":
    main()
