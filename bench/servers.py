"""The servers a run measures: ours (``llmpool serve``, or the gateway with the model-less worker),
the peers given by URL (``--peer``), and llama.cpp's llama-server started as one
(``--start-llama-server``, built by bench/build_llama_server.sh)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True, slots=True)
class Server:
    label: str
    url: str


def parse_peer(spec: str) -> Server:
    """``LABEL=URL`` or a bare ``URL`` (then the label is its host:port)."""
    label, _, url = spec.partition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    url = url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--peer wants [LABEL=]http://HOST:PORT, got {spec!r}")
    return Server(label or url.split("://", 1)[1], url)


def served_name(model: str) -> str:
    """The name `llmpool serve --model MODEL` registers the model under (a GGUF path: its file name
    without ``.gguf``), which requests must name."""
    from common.model_source import resolve_model

    return resolve_model(model).name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(
    url: str,
    path: str,
    processes: list[subprocess.Popen],
    ready: Callable[[httpx.Response], bool],
    timeout_s: float = 300,
) -> None:
    """Poll ``url + path`` until ``ready(response)``; stop early (and kill) if a process died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in processes):
        try:
            if ready(httpx.get(url + path, timeout=2)):
                return
        except (
            httpx.HTTPError,
            ValueError,
            KeyError,
        ):  # not up, or not answering in full yet
            pass
        time.sleep(0.5)
    for process in processes:
        process.kill()
    raise SystemExit(f"{url} did not become ready")


def start_llmpool(
    workers: int, extra: list[str], fake_worker: bool, fake_step_ms: float = 0.0
) -> tuple[list[subprocess.Popen], str]:
    """`llmpool serve`, or (fake_worker) the gateway plus the model-less worker."""
    port, zmq = free_port(), f"tcp://127.0.0.1:{free_port()}"
    python = sys.executable
    if fake_worker:
        commands = [
            [python, "-m", "gateway", "--port", str(port), "--zmq-bind", zmq, *extra],
            [
                python,
                "-m",
                "bench.fake_worker",
                "--gateway-address",
                zmq,
                "--step-ms",
                str(fake_step_ms),
            ],
        ]
    else:
        serve = [
            "serve",
            "--workers",
            str(workers),
            "--port",
            str(port),
            "--zmq-bind",
            zmq,
        ]
        commands = [[python, "-m", "launcher", *serve, *extra]]
    processes = [subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in commands]
    url = f"http://127.0.0.1:{port}"
    expected = 1 if fake_worker else workers
    wait_ready(url, "/workers", processes, lambda r: len(r.json()["workers"]) == expected)
    return processes, url


def llama_server_command(
    binary: str,
    gguf: Path,
    port: int,
    slots: int,
    context: int,
    threads: int,
    extra: list[str],
) -> list[str]:
    """``slots`` parallel sequences sharing one KV cache of ``context`` tokens (-kvu), the GGUF's
    own chat template (--jinja, as our gateway renders it), ``threads`` CPU threads."""
    listen = ["--host", "127.0.0.1", "--port", str(port)]
    sizes = ["-t", str(threads), "-np", str(slots), "-kvu", "-c", str(context)]
    return [binary, "-m", str(gguf), *listen, *sizes, "--jinja", *extra]


def start_llama_server(command: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """Start it with its log in ``log_path``; return once /health says the model is loaded."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}"
    wait_ready(url, "/health", [process], lambda r: r.status_code == 200, timeout_s=120)
    return process, url


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def describe(url: str) -> dict:
    """What a llama-server says about itself in /props (build, slots, context); {} for others."""
    try:
        props = httpx.get(url + "/props", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}
    if not isinstance(props, dict):
        return {}
    found = {
        "build_info": props.get("build_info"),
        "total_slots": props.get("total_slots"),
        "n_ctx": props.get("default_generation_settings", {}).get("n_ctx"),
    }
    return {key: value for key, value in found.items() if value is not None}
