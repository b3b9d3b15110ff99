"""``python -m bench.served_step [--rounds 5]``: the served time per output token at one stream
against the C++ decode step alone, in the same run (issue 39, item 5: at most 1.3x).

It starts ``llmpool serve`` (the default model, ``--server-arg`` for more flags; the environment
passes on, so ``LLMPOOL_CPU_ISA=avx2 ...`` caps both sides), builds the same model's step in this
process (as ``bench.cpu_decode`` does: one row at a 128-token context), and alternates, round by
round: the step's median over 30 calls while the server is idle, then ``--requests`` chat requests
one after another (128 tokens each, streamed) for the served TPOT median. Each round's ratio comes
from numbers taken seconds apart, so a busy machine moves both; the medians over rounds are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from pathlib import Path

import torch

from bench import servers
from bench.cpu_decode import median_s
from bench.load import run_level
from bench.prompts import PROMPTS
from bench.stats import summarize


def step_timer(model: str):  # -> a no-argument callable timing one step, in ms
    """The C++ step of one decode row at a 128-token context, as the server builds it."""
    from common.model_source import resolve_model
    from worker.build import build_engine
    from worker.config import WorkerConfig

    engine = build_engine(resolve_model(model), WorkerConfig(kv_cache_memory="256MiB", skip_self_check=True))
    runner, fused = engine.runner, engine.runner.paths.fused
    if fused is None:
        raise SystemExit("this model does not run the C++ step here")
    context, block = 128, runner.block_size
    tables = torch.arange(-(-(context + 1) // block)).unsqueeze(0)
    positions = torch.full((1,), context)
    slots = tables[:, -1] * block + context % block
    ids = torch.full((1,), 100)
    return lambda: median_s(lambda: fused(ids, positions, runner.kv_caches, slots, tables, positions + 1), 30) * 1e3


def cpu_s(launcher: int) -> dict[str, float]:
    """CPU seconds (user + system, every thread) of the launcher's gateway and worker children."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {"gateway": 0.0, "worker": 0.0}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != launcher:  # stat[1]: the parent's pid
                continue
            role = (proc / "cmdline").read_bytes().split(b"\0")[2].decode()  # python -m <role>
        except (OSError, IndexError, ValueError):
            continue
        if role in used:
            used[role] += (int(stat[11]) + int(stat[12])) / tick  # utime, stime
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3, help="streamed requests per round")
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for `llmpool serve`")
    parser.add_argument("--out")
    args = parser.parse_args()
    extra = [f"--model={args.model}", *(a for flags in args.server_arg for a in flags.split())]
    processes, url = servers.start_llmpool(1, extra, False)
    try:
        step_ms = step_timer(args.model)
        name = servers.served_name(args.model)
        asyncio.run(run_level(url, name, PROMPTS[:2], 1, 2, 16))  # warm-up
        rounds = []
        for _ in range(args.rounds):
            step = step_ms()
            before = cpu_s(processes[0].pid)
            timings, wall = asyncio.run(run_level(url, name, PROMPTS, 1, args.requests, 128))
            after, row = cpu_s(processes[0].pid), summarize(1, timings, wall)
            tpot, tokens = row["median_tpot_ms"], max(row["total_output_tokens"], 1)
            rounds.append({"step_ms": round(step, 3), "tpot_ms": tpot, "ratio": round(tpot / step, 2)})
            rounds[-1] |= {f"{r}_cpu_ms_per_token": round((after[r] - before[r]) * 1e3 / tokens, 3) for r in after}
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        servers.stop(processes)
    keys = ("step_ms", "tpot_ms", "ratio", "gateway_cpu_ms_per_token", "worker_cpu_ms_per_token")
    report = {key: statistics.median(r[key] for r in rounds) for key in keys}
    report |= {"threads": torch.get_num_threads(), "rounds": rounds}
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
