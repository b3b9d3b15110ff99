"""``python -m bench.parallel``: on this machine's CPUs, two replicas against one worker split over two
ranks (``--tensor-parallel-size 2``, then ``--pipeline-parallel-size 2``), the same model and load:
output tokens/s of N concurrent greedy completions through ``llmpool serve``. docs/parallel.md
reports its figures.

    python -m bench.random_llama /tmp/smol-even --size smol-even   # 2 ranks split 8 / 4 heads
    python -m bench.parallel --model /tmp/smol-even [--clients 8] [--tokens 64] [--extra "--dtype float32"]

(The default model's 9 / 3 heads split only by 3: ``--tensor-parallel-size 2`` refuses it.)
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import httpx

CONFIGS = {
    "2 replicas": ["--workers", "2"],
    "1 worker, --tensor-parallel-size 2": ["--workers", "1", "--tensor-parallel-size", "2"],
    "1 worker, --pipeline-parallel-size 2": ["--workers", "1", "--pipeline-parallel-size", "2"],
}


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(model: str, flags: list[str], clients: int, tokens: int, workers: int) -> float:
    """Output tokens/s of ``clients`` concurrent completions (after one warm-up round)."""
    port, zmq = _port(), _port()
    command = [sys.executable, "-m", "launcher", "serve", "--model", model, "--port", str(port)]
    command += ["--zmq-bind", f"tcp://127.0.0.1:{zmq}", *flags]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"llmpool serve {' '.join(flags)} exited with code {server.returncode}")
            try:
                if len(httpx.get(url + "/workers", timeout=5).json()["workers"]) == workers:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        name = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        body = {"model": name, "prompt": "Tell me a story about", "max_tokens": tokens, "temperature": 0}
        body["ignore_eos"] = True

        def one(_: int) -> int:
            response = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
            return response["usage"]["completion_tokens"]

        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(one, range(clients)))  # warm-up
            started = time.perf_counter()
            total = sum(pool.map(one, range(clients)))
        return total / (time.perf_counter() - started)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--extra", default="--dtype float32", help="flags for both set-ups")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPUs; {args.clients} clients x {args.tokens} tokens; model {args.model}; {args.extra}")
    for label, flags in CONFIGS.items():
        workers = int(flags[1])
        rate = run(args.model, flags + shlex.split(args.extra), args.clients, args.tokens, workers)
        print(f"| {label} | {rate:.1f} tokens/s |", flush=True)


if __name__ == "__main__":
    main()
