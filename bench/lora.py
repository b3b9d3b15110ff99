"""``python -m bench.lora [--rows 1,8,32] [--rank 8]``: what LoRA rows cost a decode step, in-process
(the engine alone, the default model in bf16, two random adapters of every projection).

Each batch size runs four batches, alternating in rounds so that a busy machine loads them alike:
``base`` (the worker's default path: the C++ step with its packed weights), ``base-torch`` (the same
rows through the torch path), ``mixed`` (rows of the base, adapter a and adapter b in turn; one row:
adapter a) and ``one-adapter`` (every row adapter a); the adapters' rows take the C++ step too, which
adds their low-rank products. Figures are the
median decode step time over each round's steps, then the median over rounds. Check the load first
(``uptime``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

MODEL = "SmolLM2-135M-Instruct"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODES = ("base", "base-torch", "mixed", "one-adapter")


def make_adapters(folder: Path, rank: int) -> dict[str, Path]:
    """Two random peft adapters of the default model (A and B both drawn: peft starts B at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model

    source = resolve_model(MODEL)
    out = {}
    for seed, name in enumerate(("a", "b")):
        base = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.bfloat16)
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_" in param_name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        model.save_pretrained(folder / name)
        out[name] = folder / name
    return out


def step_times(engine, rows: int, mode: str, steps: int, serial: list[int]) -> float:  # engine: worker.engine.Engine
    """Median decode step time of ``rows`` requests of ``mode``, once every row decodes."""
    from common.protocol import NewRequest, SamplingParams

    adapters = {"base": [None], "base-torch": [None], "mixed": [None, "a", "b"], "one-adapter": ["a"]}[mode]
    if mode == "mixed" and rows == 1:
        adapters = ["a"]
    generator = torch.Generator().manual_seed(rows)
    ids = []
    for i in range(rows):
        serial[0] += 1
        rid = f"{mode}-{serial[0]}"
        prompt = torch.randint(100, 40_000, (64,), generator=generator).tolist()
        lora = adapters[i % len(adapters)]
        engine.add_request(
            NewRequest(rid, prompt, steps + 64, SamplingParams(temperature=0), ignore_eos=True, lora=lora)
        )
        ids.append(rid)
    paths = engine.runner.paths
    fast = paths.fast
    paths.fast = fast and mode != "base-torch"
    try:
        while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    finally:
        paths.fast = fast
        engine.abort(ids)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="the worker's --threads (0: every usable CPU)")
    parser.add_argument("--out")
    args = parser.parse_args()
    from common.model_source import resolve_model
    from worker.build import build_engine
    from worker.config import WorkerConfig

    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(Path(tmp), args.rank)
        config = WorkerConfig(kv_cache_memory="1GiB", max_num_seqs=64, lora=[f"{n}={p}" for n, p in adapters.items()])
        engine = build_engine(resolve_model(MODEL), config)
        report = {
            "model": MODEL,
            "quantization": engine.runner.quantization,
            "threads": torch.get_num_threads(),
            "rank": args.rank,
            "rows": {},
        }
        serial = [0]
        for rows in map(int, args.rows.split(",")):
            rounds = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    rounds[mode].append(step_times(engine, rows, mode, args.steps, serial))
            ms = {mode: round(statistics.median(t) * 1000, 2) for mode, t in rounds.items()}
            report["rows"][rows] = ms
            print(
                f"{rows:>3} rows: "
                + ", ".join(f"{mode} {value:.2f} ms" for mode, value in ms.items())
                + f"; mixed / base-torch {ms['mixed'] / ms['base-torch']:.2f}x, mixed / base {ms['mixed'] / ms['base']:.2f}x",
                flush=True,
            )
    print(json.dumps(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
