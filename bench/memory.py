"""``python -m bench.memory [--model M] [--llama-server PATH] [--input-len 1024]``: time to first token
of a long prompt and the resident memory of each server on the same GGUF: llmpool as it starts by
default (the float copy for prompts beside the C++ step's quantized copy), llmpool with
``--quantized-only``, and llama.cpp's llama-server; with this CPU's compute limit measured in the
same run.

Each round sends a fresh prompt of ``--input-len`` random token ids (nothing cached) to
``/v1/completions`` with ``max_tokens`` 1, timed end to end; the figure is the median. Memory is
the worker's (or llama-server's) resident set after the rounds (``VmRSS``) and its peak
(``VmHWM``), from /proc. The compute limit is a large bf16 matrix product (oneDNN, AMX where the
CPU has it) in this process, all threads; a prompt's forward needs about 2 x parameters x tokens
FLOPs, so the share says how close a prefill comes. Check the load first (``uptime``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from bench import servers


def matmul_tflops(size: int = 4096, repeats: int = 5) -> float:
    import torch

    a, b = (torch.randn(size, size).to(torch.bfloat16) for _ in range(2))
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e12


def ttft_s(url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start


def memory_mb(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = round(int(value.split()[0]) / 1024, 1)
    return {"rss_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"]}


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def worker_pid(launcher: int) -> int:
    """The worker process `llmpool serve` started (its command line runs ``-m worker``)."""
    for pid in descendants(launcher):
        if b"worker" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2:3]:
            return pid
    raise SystemExit("no worker process under the launcher")


def measure(label: str, url: str, model: str, pid: int, prompts: list[list[int]]) -> dict:
    ttft_s(url, model, prompts[0][:64])  # warm up
    times = [ttft_s(url, model, p) for p in prompts]
    row = {
        "server": label,
        "ttft_s": round(statistics.median(times), 3),
        "all_s": [round(t, 3) for t in times],
        **memory_mb(pid),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--llama-server", help="llama-server binary to measure on the same GGUF")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(args.rounds)]
    limit = matmul_tflops()
    print(json.dumps({"bf16_matmul_tflops": round(limit, 2)}), flush=True)
    rows = []
    for label, extra in (("llmpool", []), ("llmpool --quantized-only", ["--quantized-only"])):
        processes, url = servers.start_llmpool(1, [f"--model={args.model}", *extra], False)
        try:
            rows.append(measure(label, url, servers.served_name(args.model), worker_pid(processes[0].pid), prompts))
        finally:
            servers.stop(processes)
    if args.llama_server:
        from common.model_source import resolve_model

        source = resolve_model(args.model)
        gguf = Path(source.path) / source.gguf_file
        command = servers.llama_server_command(
            args.llama_server, gguf, servers.free_port(), 1, args.input_len + 64, 2, []
        )
        process, peer = servers.start_llama_server(command, Path("bench-results") / "llama-server-memory.log")
        try:
            rows.append(measure("llama-server", peer, servers.served_name(args.model), process.pid, prompts))
        finally:
            servers.stop([process])
    result = {"model": args.model, "input_len": args.input_len, "bf16_matmul_tflops": round(limit, 2), "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
