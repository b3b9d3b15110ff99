"""``python -m bench.gpu_decode MODEL [MODEL...] --out FILE``: batch-1 decode time per token on a
CUDA GPU against the HBM bandwidth limit, with CUDA graphs on and off, for each decode attention
backend (the Triton kernel, and FlashInfer where it is installed); in-process engine, no HTTP.

The limit is the bytes a decode step must read (every weight once, the embedding matrix as the
LM head included, plus the context's keys and values) over the memory bandwidth: the H100 SXM's
datasheet 3.35 TB/s, and what a device-to-device copy reaches here (read + write bytes / time).
Without graphs it also counts the GPU kernels a decode step launches (torch's profiler), per step
and per layer: what a replayed graph runs too, and what a launch-bound step pays for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from worker.attention import flashinfer_decode
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine

DATASHEET_TBPS = {"H100": 3.35, "H200": 4.8}


def copy_bandwidth() -> float:
    """Bytes/s a device-to-device copy of 1 GiB moves, counting the bytes read and written."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 20 / (time.perf_counter() - start)


def step_bytes(engine: Engine, context: int) -> int:
    """Weights read once per step (tied embeddings once, as the LM head) plus the context's K and V."""
    runner = engine.runner
    native = runner.native
    tensors = list(runner.model.parameters())  # tied embeddings and LM head are one parameter
    if native is not None:  # the fused copies replaced the layers' own weights
        for layer in native.layers:
            tensors += [
                layer.qkv.weight,
                layer.o_proj.weight,
                layer.gate_up.weight,
                layer.down.weight,
                layer.input_norm,
                layer.post_norm,
            ]
    k, v = runner.kv_caches[0]
    per_token = 2 * len(runner.kv_caches) * k[0, 0].numel() * k.element_size()
    return sum(t.numel() * t.element_size() for t in tensors) + context * per_token


def decode_ms(engine: Engine, prompt_len: int, new_tokens: int) -> float:
    """Median wall time of the decode steps of one request (prompt of ``prompt_len`` tokens)."""
    prompt = [1] + [1000 + (7 * i) % 30000 for i in range(prompt_len - 1)]
    engine.add_request(NewRequest("d", prompt, new_tokens, SamplingParams(temperature=0), ignore_eos=True))
    times = []
    while engine.has_work():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])  # the first step is the prefill


def kernels_per_step(engine: Engine, steps: int = 4) -> float | None:
    """GPU kernels (and copies) one decode step launches, counted by torch's profiler over ``steps``
    decode steps of one request; None where the profiler cannot count them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine.add_request(
        NewRequest("k", [1, 1000, 1001, 1002], steps + 1, SamplingParams(temperature=0), ignore_eos=True)
    )
    engine.step()  # the prefill
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            while engine.has_work():
                engine.step()
            torch.cuda.synchronize()
    except Exception as exc:  # a figure we can do without
        print(f"kernel count failed: {exc}", flush=True)
        return None
    launched = sum(event.count for event in prof.key_averages() if event.device_type == DeviceType.CUDA)
    return launched / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--attention",
        default="triton,flashinfer",
        help="decode attention backends to time (flashinfer only where it is installed)",
    )
    args = parser.parse_args()
    attentions = [a for a in args.attention.split(",") if a != "flashinfer" or flashinfer_decode.available()]
    name = torch.cuda.get_device_name()
    measured = copy_bandwidth()
    datasheet = next((tbps * 1e12 for key, tbps in DATASHEET_TBPS.items() if key in name), measured)
    results = {"gpu": name, "copy_bandwidth_tbps": measured / 1e12, "datasheet_tbps": datasheet / 1e12, "runs": []}
    runs = [(attention, graphs) for attention in attentions for graphs in ("on", "off")]
    for model in args.models:
        for attention, graphs in runs:
            settings = {"cuda_graphs": graphs, "cuda_attention": attention}
            config = WorkerConfig(
                model=model, device="cuda", dtype="bfloat16", kv_cache_memory="4GiB", max_num_seqs=8, **settings
            )
            engine = build_engine(resolve_model(model), config)
            decode_ms(engine, 32, 16)  # warm-up
            ms = decode_ms(engine, args.prompt_len, args.new_tokens)
            nbytes = step_bytes(engine, args.prompt_len + args.new_tokens // 2)
            kernels = kernels_per_step(engine) if graphs == "off" else None
            layers = len(engine.runner.kv_caches)
            run = {
                "model": model,
                "cuda_attention": attention,
                "cuda_graphs": graphs,
                "context": args.prompt_len + args.new_tokens // 2,
                "step_ms": round(ms, 3),
                "tokens_per_s": round(1000 / ms, 1),
                "step_mb": round(nbytes / 1e6, 1),
                "limit_ms_datasheet": round(1000 * nbytes / datasheet, 3),
                "limit_ms_copy": round(1000 * nbytes / measured, 3),
                "share_of_datasheet_limit": round(nbytes / datasheet * 1000 / ms, 3),
                "share_of_copy_limit": round(nbytes / measured * 1000 / ms, 3),
                "kernels_per_step": kernels,
                "kernels_per_layer": None if kernels is None else round(kernels / layers, 1),
            }
            print(json.dumps(run), flush=True)
            results["runs"].append(run)
            del engine
            torch.cuda.empty_cache()
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
