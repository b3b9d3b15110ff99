"""Shared fixtures: real gateway and worker processes on loopback, started once per session.

Every process writes its log to ``test-artifacts/<name>.log`` so a failure can be read afterwards.
The default model loads from the conversion cache (~0.2 s) after the first run (~12 s).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "test-artifacts"
MODEL = "SmolLM2-135M-Instruct"
# Each gateway a test starts keeps its state (stored responses) in a file of its own, in a folder of
# this run, unless the test names one (LLMPOOL_STATE_URL): no test sees another run's responses.
STATE_DIR = Path(tempfile.mkdtemp(prefix="llmpool-test-state-"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    """Poll ``check`` every ``interval`` seconds until it holds; TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def spawn(args: list[str], name: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m <args>`` with its output in test-artifacts/<name>.log."""
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / f"{name}.log", "ab")
    state = f"sqlite:///{STATE_DIR}/{name}-{time.monotonic_ns()}.db"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "LLMPOOL_STATE_URL": state, **(env or {})}
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen, timeout: float = 15) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Server:
    """A running gateway (and its workers) reachable on ``base_url``."""

    port: int
    zmq_port: int
    processes: list[subprocess.Popen] = field(default_factory=list)
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_address(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=10, headers=self.headers)

    def post(self, path: str, headers: dict[str, str] | None = None, **kwargs: object) -> httpx.Response:
        return httpx.post(self.base_url + path, timeout=120, headers={**self.headers, **(headers or {})}, **kwargs)

    def workers(self) -> list[dict]:
        return self.get("/workers").json()["workers"]

    def wait_for_workers(self, count: int, timeout: float = 180) -> None:
        wait_until(lambda: len(self.workers()) == count, timeout, f"{count} registered workers")

    def wait_idle(self, timeout: float, what: str) -> None:
        """Every worker idle (nothing in flight, running or waiting) and every KV block back, as
        load reports sent after this call say (two more heartbeats, so a whole interval)."""
        seen = {w["name"]: w["heartbeats"] for w in self.workers()}

        def idle() -> bool:
            return all(
                w["heartbeats"] >= seen[w["name"]] + 2
                and w["inflight"] == 0
                and w["running"] == 0
                and w["waiting"] == 0
                and w["free_blocks"] == w["total_blocks"]
                for w in self.workers()
            )

        wait_until(idle, timeout, what)

    def stop(self) -> None:
        for process in reversed(self.processes):
            stop(process)


def worker_argv(gateway: str, name: str | None = None, *extra: str, fake_info: str | Path | None = None) -> list[str]:
    """``llmpool worker`` arguments: a worker (of the default model unless ``extra`` says otherwise)
    dialing ``gateway`` (one address or several, comma-separated), named ``name``, with ``extra``.
    ``fake_info``: a model-less worker instead (bench/fake_worker.py), its tokenizer's ModelInfo
    cached in that file."""
    program = ["bench.fake_worker", "--model-info", str(fake_info)] if fake_info else ["worker"]
    return [*program, "--gateway-address", gateway, *(["--worker-name", name] if name else []), *extra]


def start_serve(name: str, workers: int, *extra: str, env: dict[str, str] | None = None, wait: bool = True) -> Server:
    """``llmpool serve`` (the launcher) with ``workers`` local workers, waited on until they registered
    (``wait=False``: not waited on, so several start at once; ``wait_for_workers`` then)."""
    api_key = (env or {}).get("LLMPOOL_API_KEY", "").split(",")[0] or None
    server = Server(free_port(), free_port(), api_key=api_key)
    args = [
        "launcher",
        "serve",
        "--workers",
        str(workers),
        "--port",
        str(server.port),
        "--zmq-bind",
        server.zmq_address,
        *extra,
    ]
    server.processes.append(spawn(args, name, env))
    try:
        if wait:
            server.wait_for_workers(workers)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The shared server: the launcher with two workers, as `llmpool serve --workers 2` starts it."""
    srv = start_serve("serve-session", 2)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def keyed_server() -> Iterator[Server]:
    """One launcher with one worker behind API keys (``key-one``, ``key-two``) and an admin key
    (``admin-key``), for the session: the key tests of the API, the page and the deploy probe share it
    (a server start is ~15 s of this machine's two cores)."""
    keys = {"LLMPOOL_API_KEY": "key-one,key-two", "LLMPOOL_ADMIN_KEY": "admin-key"}
    srv = start_serve("serve-apikey", 1, env=keys)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def templating() -> Iterator[Server]:
    """One launcher with one worker that takes a request's own chat template
    (``--allow-request-chat-template``), for the session: the template tests and those that want a
    worker alone (test_engine_behaviour) share it. Warmed by a first chat (a worker's first step
    compiles, seconds) so tests that time a template's deadline or a stream's gaps do not time that."""
    srv = start_serve("templating", 1, "--allow-request-chat-template")
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert srv.post("/v1/chat/completions", json=chat).status_code == 200
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server: Server):  # an openai.OpenAI
    """The OpenAI SDK pointed at the shared server, as a user would point it."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tokenizer():  # a transformers tokenizer
    from common.config import CACHE_DIR
    from common.model_source import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(MODEL), CACHE_DIR.env_default())


@pytest.fixture(scope="session")
def postgres():  # a tests.postgres.Postgres
    """A real PostgreSQL server (Debian's package) for the whole session; skipped where none is installed."""
    from tests.postgres import Postgres, binaries

    if binaries() is None:
        pytest.skip("PostgreSQL is not installed: scripts/setup.sh --test installs it (apt-get install postgresql)")
    server = Postgres()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of the tests' own on loopback (scripts/setup.sh --test installs it), with a
    memory bound and the eviction policy docs/kv-store.md asks of a shared Redis (volatile-ttl: the
    block whose expiry comes first, the least recently used unless retained)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/setup.sh --test installs it)")
    port = free_port()
    folder = tmp_path_factory.mktemp("redis")
    args = ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)]
    ARTIFACTS.mkdir(exist_ok=True)
    with open(ARTIFACTS / "redis.log", "ab") as log:
        process = subprocess.Popen(
            [
                "redis-server",
                *args,
                "--maxmemory",
                "256mb",
                "--maxmemory-policy",
                "volatile-ttl",
                "--maxmemory-samples",
                "16",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        import redis

        client = redis.Redis(port=port)
        wait_until(lambda: _pings(client), 20, "redis-server")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(process)


def _pings(client) -> bool:  # a redis.Redis
    import redis

    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


@dataclass
class S3Server:
    """A real S3-compatible HTTP server (moto's) on loopback, with one bucket made for the tests."""

    endpoint: str
    bucket: str = "llmpool-tests"
    # moto takes any credentials; boto3 still wants some, from the usual variables.
    env: dict[str, str] = field(
        default_factory=lambda: {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )

    def client(self):  # a boto3 S3 client
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )

    def keys(self, prefix: str) -> list[str]:
        listed = self.client().list_objects_v2(Bucket=self.bucket, Prefix=prefix)
        return [item["Key"] for item in listed.get("Contents", [])]


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """moto's S3 server as a process for the whole session (no S3 server is packaged by Debian, and
    there is no Docker here); scripts/setup.sh --test installs it with the test extras."""
    import importlib.util

    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        pytest.skip("moto[server] is not installed (scripts/setup.sh --test installs it)")
    port = free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    with open(ARTIFACTS / "moto-s3.log", "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        server = S3Server(f"http://127.0.0.1:{port}")
        wait_until(lambda: httpx.get(server.endpoint + "/moto-api/", timeout=2).status_code == 200, 30, "moto_server")
        server.client().create_bucket(Bucket=server.bucket)
        yield server
    finally:
        stop(process)
