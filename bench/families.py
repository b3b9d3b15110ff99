"""``python -m bench.families [--families qwen3,gemma2,...] [--out FILE]``: per-token decode time of
each model family on the fused C++ step against the torch path (transformers' classes) at the same
size, batch 1 and 32, in the worker's engine.

Every family is built from its config class at one shape (hidden 1024, 8 layers, 16 query / 4 KV
heads of 64, MLP 2816, vocabulary 32,000; MoE families 8 experts, 2 routed, of MLP 704, so the
routed FLOPs match), random weights in bf16, saved to a temporary folder and served from there like
any model. The fused step runs int8 weights (the default for a bf16 model on a VNNI CPU); the
torch path runs the bf16 weights with ``--model-impl transformers --quantization none`` and the C++ step switched off. Each
figure is the median step time over decode steps after warm-up; 2 cores, so check the load first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

FAMILIES = [
    "llama",
    "qwen3",
    "mistral",
    "gemma2",
    "gemma3_text",
    "phi3",
    "granite",
    "olmo2",
    "smollm3",
    "mixtral",
    "qwen3_moe",
    "olmoe",
]
SHAPE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
)
MOE = {"num_local_experts": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 704}


def build(kind: str, folder: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {**MOE, "intermediate_size": 704} if kind in ("mixtral", "qwen3_moe", "olmoe") else {}
    config = AutoConfig.for_model(
        kind, **{**SHAPE, **extra}, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def step_ms(folder: Path, rows: int, fused: bool, steps: int = 12) -> float:
    from common.model_source import resolve_model
    from common.protocol import NewRequest, SamplingParams
    from worker.build import build_engine
    from worker.config import WorkerConfig

    settings = {} if fused else {"model_impl": "transformers", "quantization": "none"}
    engine = build_engine(
        resolve_model(str(folder)),
        WorkerConfig(dtype="bfloat16", kv_cache_memory="512MiB", max_num_seqs=64, skip_self_check=True, **settings),
    )
    if not fused:  # bf16 on a CPU takes the C++ step wherever it knows the family: switch it off here
        engine.runner.paths.fast = False
    assert engine.runner.paths.fast == fused and (fused or engine.runner.native is None), (
        "the path asked for is the one that runs"
    )
    for i in range(rows):
        engine.add_request(
            NewRequest(f"r{i}", [3 + i, 7, 11, 13], steps + 4, SamplingParams(temperature=0), ignore_eos=True)
        )
    times = []
    while engine.has_work():
        start = time.perf_counter()
        out = engine.step()
        if out.batch_size == rows and all(len(o.new_token_ids) == 1 for o in out.outputs):
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.families.split(","):
            folder = build(kind, Path(tmp) / kind)
            row = {"family": kind}
            for rows in (1, 32):
                row[f"fused_ms_b{rows}"] = round(step_ms(folder, rows, fused=True), 2)
                row[f"torch_ms_b{rows}"] = round(step_ms(folder, rows, fused=False), 2)
            print(json.dumps(row), flush=True)
            results.append(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
