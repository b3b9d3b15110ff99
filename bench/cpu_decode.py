"""``python -m bench.cpu_decode --model M [--rows 1,8,32]``: the CPU decode step against this
machine's memory-bandwidth limit, measured in the same run.

The limit is a plain read of a buffer as large as the step's weights (a sum over it, every thread);
each step reads its weights once (and its context's keys and values), so bytes over step time,
divided by the limit, is the share of the bandwidth the step reaches. For one row the step is split
into its parts: the layers (``decoder_step``), the LM head (``linear``), and the embedding and
rotary tables in Python; all timings are medians after warm-up. Check the load first (``uptime``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def median_s(fn, repeats: int = 20) -> float:  # a no-argument callable
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_limit(nbytes: int) -> float:
    """Bytes per second of a plain read of ``nbytes`` (a sum over them)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / median_s(lambda: buffer.sum(), 10)


def tensor_bytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--context", type=int, default=128, help="tokens each row has seen")
    parser.add_argument("--out")
    args = parser.parse_args()
    from common.model_source import resolve_model
    from worker import kernels
    from worker.build import build_engine
    from worker.config import WorkerConfig

    engine = build_engine(resolve_model(args.model), WorkerConfig(kv_cache_memory="1GiB", max_num_seqs=64))
    runner, fused = engine.runner, engine.runner.paths.fused
    if fused is None:
        raise SystemExit("this model does not run the fused step here")
    weights = tensor_bytes([*fused.weights, *fused.experts, fused.lm_head, fused.lm_head_scale])
    k, _ = runner.kv_caches[0]
    kv_per_token = 2 * len(runner.kv_caches) * k[0, 0].numel() * k.element_size()
    limit = read_limit(weights)
    report = {
        "model": args.model,
        "quantization": runner.quantization,
        "threads": torch.get_num_threads(),
        "weight_mb": round(weights / 1e6, 1),
    }
    report["read_limit_gb_s"] = round(limit / 1e9, 1)
    block = runner.block_size
    for rows in map(int, args.rows.split(",")):
        blocks = -(-(args.context + 1) // block)
        tables = torch.tensor([[r * blocks + b for b in range(blocks)] for r in range(rows)])
        positions = torch.full((rows,), args.context)
        slots = tables[:, -1] * block + args.context % block
        ids = torch.full((rows,), 100)

        def step() -> torch.Tensor:
            return fused(ids, positions, runner.kv_caches, slots, tables, positions + 1)

        seconds = median_s(step)
        moved = weights + rows * (args.context + 1) * kv_per_token
        row = {
            "rows": rows,
            "step_ms": round(seconds * 1e3, 3),
            "gb_s": round(moved / seconds / 1e9, 1),
            "share": round(moved / seconds / limit, 3),
        }
        if rows == 1:
            hidden = fused.embed(ids)
            head = median_s(lambda: kernels.ops().linear(hidden.float(), fused.lm_head, fused.lm_head_scale, None))
            row["lm_head_ms"] = round(head * 1e3, 3)
            row["lm_head_mb"] = round(tensor_bytes([fused.lm_head, fused.lm_head_scale]) / 1e6, 1)
        report[f"rows_{rows}"] = row
        print(json.dumps(row), flush=True)
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
