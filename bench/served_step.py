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
import statistics

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
            timings, wall = asyncio.run(run_level(url, name, PROMPTS, 1, args.requests, 128))
            tpot = summarize(1, timings, wall)["median_tpot_ms"]
            rounds.append({"step_ms": round(step, 3), "tpot_ms": tpot, "ratio": round(tpot / step, 2)})
            print(json.dumps(rounds[-1]), flush=True)
    finally:
        servers.stop(processes)
    report = {key: statistics.median(r[key] for r in rounds) for key in ("step_ms", "tpot_ms", "ratio")}
    report |= {"threads": torch.get_num_threads(), "rounds": rounds}
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
