"""``python -m bench.one_stream_ttft MODEL [--requests 12] [--server-arg "..."]``: one-stream chat
requests one after another (the chat workload's bodies, 128 out) against a fresh `llmpool serve`,
each request's TTFT as the gateway logs it ("first token"), and how many Triton kernels the
server compiled so far (its TRITON_CACHE_DIR). It tells a stall in the worker from a kernel
compiled mid-request (docs/gpu.md, "A second GPU run"). MODEL is a folder (served by its name, the
server running from its parent) or a model name.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.load import request_body
from bench.prompts import PROMPTS
from bench.servers import free_port, stop, wait_ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--server-arg", default="", help="more `llmpool serve` flags, e.g. '--device cuda'")
    args = parser.parse_args()
    folder = Path(args.model)
    cwd, name = (folder.parent, folder.name) if folder.is_dir() else (Path.cwd(), args.model)
    scratch = Path(tempfile.mkdtemp(prefix="ttft-"))
    cache, log_path = scratch / "triton", scratch / "server.log"
    port = free_port()
    command = [sys.executable, "-m", "launcher", "serve", "--port", str(port)]
    command += ["--zmq-bind", f"tcp://127.0.0.1:{free_port()}", "--model", name, *shlex.split(args.server_arg)]
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache), PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    with log_path.open("w") as log:
        procs = [subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, "/workers", procs, lambda r: len(r.json()["workers"]) == 1)
        for i in range(args.requests):
            body = request_body(name, PROMPTS[i % len(PROMPTS)], 128)
            with httpx.stream("POST", url + "/v1/chat/completions", content=body, timeout=120) as response:
                for _ in response.iter_lines():
                    pass
            time.sleep(0.3)  # let the gateway log it
            firsts = re.findall(r"first token (\d+) ms", log_path.read_text())
            kernels = sum(1 for _ in cache.rglob("*.cubin")) if cache.exists() else 0
            print(f"request {i}: gateway's first token {firsts[-1] if firsts else '?'} ms, Triton kernels {kernels}")
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
