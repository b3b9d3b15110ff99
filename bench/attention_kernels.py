"""``python -m bench.attention_kernels --out FILE``: the decode attention backends of a CUDA worker,
side by side on the same paged caches: the eager gather + matmul, the Triton kernel, and FlashInfer
where it is installed (the backends of worker/attention, one layer's call).

Each figure is the median of timed calls (CUDA events) after warm-up; FlashInfer's host-side
``plan``, made once per step rather than per layer, is timed apart. The bandwidth column counts the
keys and values the rows read once, over the call's time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from worker.attention import DecodeGroup, EagerDecode, flashinfer_decode, triton_decode

# (rows, context tokens per row): one long row, a mid batch, a full batch
SHAPES = [(1, 4096), (1, 32768), (32, 1024), (256, 1024)]
HEADS = {"llama-1b": (32, 8, 64), "smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}


def time_us(fn, iterations: int = 50) -> float:  # a no-argument callable
    for _ in range(3):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def measure(rows: int, context: int, heads: tuple[int, int, int], dtype: torch.dtype, block_size: int = 16) -> dict:
    query_heads, kv_heads, head_dim = heads
    device = torch.device("cuda")
    blocks_per_row = -(-context // block_size)
    k_cache, v_cache = (
        torch.randn(rows * blocks_per_row, block_size, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2)
    )
    order = torch.randperm(rows * blocks_per_row).tolist()  # scattered pages, as a long-running cache has
    tables = [order[r * blocks_per_row : (r + 1) * blocks_per_row] for r in range(rows)]
    lengths = [context] * rows
    group = DecodeGroup(0, rows, torch.tensor(tables, device=device), torch.tensor(lengths, device=device), context)
    query = torch.randn(rows, query_heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    kv_bytes = 2 * rows * context * kv_heads * head_dim * k_cache.element_size()
    result: dict = {
        "rows": rows,
        "context": context,
        "heads": heads,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_mb": round(kv_bytes / 1e6, 1),
    }
    backends = {"eager": EagerDecode(), "triton": triton_decode.TritonDecode()}
    if flashinfer_decode.available():
        backends["flashinfer"] = flashinfer = flashinfer_decode.FlashInferBackend(device)
        flashinfer.prepare([(k_cache, v_cache)], query_heads)
        start = time.perf_counter()
        for _ in range(20):
            flashinfer.plan(group, tables, lengths)
        result["flashinfer_plan_us"] = round((time.perf_counter() - start) / 20 * 1e6, 1)
    want = backends["eager"](query, k_cache, v_cache, group, scale).float()
    for name, backend in backends.items():
        if name == "eager" and rows * context > 256 * 1024:
            continue  # the gathered copy alone would take gigabytes
        out = backend(query, k_cache, v_cache, group, scale).float()
        us = time_us(lambda: backend(query, k_cache, v_cache, group, scale))
        result[name] = {
            "us": round(us, 1),
            "tb_per_s": round(kv_bytes / us / 1e6, 2),
            "max_error": round((out - want).abs().max().item(), 4),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="llama-1b,smollm2", help=f"head shapes, of {', '.join(HEADS)}")
    args = parser.parse_args()
    report = {
        "gpu": torch.cuda.get_device_name(),
        "flashinfer": flashinfer_decode.available(),
        "triton": triton_decode.available(),
        "runs": [],
    }
    if report["flashinfer"]:
        report["flashinfer_version"] = flashinfer_decode.flashinfer.__version__
    for model in args.models.split(","):
        for rows, context in SHAPES:
            run = {"model": model, **measure(rows, context, HEADS[model], torch.bfloat16)}
            print(json.dumps(run), flush=True)
            report["runs"].append(run)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
