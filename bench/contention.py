"""``python -m bench.contention [--model M] [--llama-server PATH] [--rounds 5]``: one stream's answer
time on a quiet machine and with one busy process beside the server (``python3 -c "while True:
pass"``, a noisy neighbour or a CPU limit's lost core), for llmpool and llama-server on the same
GGUF, alternating quiet and busy round by round.

Each round asks for a 128-token answer (``ignore_eos``) of the same chat prompt and times it end to
end; the figures are per-server medians and the busy/quiet ratio. The quiet rounds need a quiet
machine: check the load first (``uptime``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench import servers

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def answer_s(url: str, model: str, tokens: int) -> float:
    body = {"model": model, "messages": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    reply.raise_for_status()
    return time.perf_counter() - start


def busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def measure(label: str, url: str, model: str, rounds: int, tokens: int) -> dict:
    answer_s(url, model, 8)  # warm up
    quiet, loaded = [], []
    for _ in range(rounds):
        quiet.append(answer_s(url, model, tokens))
        spinner = busy()
        try:
            time.sleep(0.5)  # let the scheduler place it
            loaded.append(answer_s(url, model, tokens))
        finally:
            spinner.kill()
            spinner.wait()
    q, b = statistics.median(quiet), statistics.median(loaded)
    row = {
        "server": label,
        "quiet_s": round(q, 3),
        "busy_s": round(b, 3),
        "ratio": round(b / q, 2),
        "quiet_all": quiet,
        "busy_all": loaded,
    }
    print(json.dumps({k: v for k, v in row.items() if not k.endswith("_all")}), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--llama-server", help="llama-server binary to measure on the same GGUF")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--server-arg", action="append", default=[], help="extra flag for `llmpool serve`")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    processes, url = servers.start_llmpool(1, [f"--model={args.model}", *args.server_arg], False)
    try:
        rows.append(measure("llmpool", url, servers.served_name(args.model), args.rounds, args.tokens))
    finally:
        servers.stop(processes)
    if args.llama_server:
        from common.model_source import resolve_model

        source = resolve_model(args.model)
        gguf = Path(source.path) / source.gguf_file
        command = servers.llama_server_command(args.llama_server, gguf, servers.free_port(), 1, 2048, 2, [])
        process, peer = servers.start_llama_server(command, Path("bench-results") / "llama-server-contention.log")
        try:
            rows.append(measure("llama.cpp", peer, servers.served_name(args.model), args.rounds, args.tokens))
        finally:
            servers.stop([process])
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
