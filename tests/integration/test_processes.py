"""Process-level behaviour: separate gateway and worker over tcp, worker crashes, launcher shutdown,
and the commands that compose.yaml runs, run here as plain processes (the containers themselves:
tests/deploy/test_docker_real.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.conftest import ARTIFACTS, MODEL, REPO, Server, free_port, spawn, start_serve, stop, wait_until, worker_argv
from tests.integration.test_faults import stream_text

FAST_HEARTBEAT = {"LLMPOOL_HEARTBEAT_INTERVAL": "0.5", "LLMPOOL_HEARTBEAT_LIVENESS": "4"}


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_sigkilled_worker_fails_its_requests_and_the_gateway_stays_up():
    server = Server(free_port(), free_port())
    gateway = spawn(
        ["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address], "kill-gateway", FAST_HEARTBEAT
    )
    worker = spawn(worker_argv(server.zmq_address), "kill-worker", FAST_HEARTBEAT)
    server.processes += [gateway, worker]
    try:
        server.wait_for_workers(1)
        client = sdk(server)
        received: list[str] = []
        errors: list[Exception] = []
        started = threading.Event()

        def long_stream() -> None:
            try:
                for chunk in client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Tell a long story."}],
                    max_tokens=4000,
                    stream=True,
                    extra_body={"ignore_eos": True},
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        received.append(chunk.choices[0].delta.content)
                        started.set()
            except Exception as exc:  # what the client sees when the worker dies
                errors.append(exc)

        thread = threading.Thread(target=long_stream)
        thread.start()
        assert started.wait(60), "the stream never started"
        worker.send_signal(signal.SIGKILL)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the stream did not end after its worker died"
        assert received and len(errors) == 1 and "no other worker" in str(errors[0])
        assert server.get("/health").status_code == 200
        wait_until(lambda: server.get("/ready").status_code == 503, 10, "the dead worker to be dropped")
        with pytest.raises(openai.InternalServerError) as info:  # 503: no worker left
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert info.value.status_code == 503
        # A new worker joins the running gateway and serving resumes.
        server.processes.append(spawn(worker_argv(server.zmq_address), "kill-worker-2", FAST_HEARTBEAT))
        server.wait_for_workers(1)
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        ).choices
    finally:
        server.stop()


def _children(pid: int) -> set[int]:
    """All descendants of ``pid`` (from /proc)."""
    found: set[int] = set()
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == parent and int(entry.name) not in found:
                    found.add(int(entry.name))
                    frontier.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def launchers() -> Iterator[dict[str, Server]]:
    """Two serving launchers for the signal tests, started together (their workers load side by side)."""
    servers = {name: start_serve(f"launcher-{name}", 1, wait=False) for name in ("SIGINT", "killed")}
    try:
        for server in servers.values():
            server.wait_for_workers(1)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def test_launcher_stops_everything_on_sigint(launchers):
    launcher = launchers["SIGINT"].processes[0]
    children = _children(launcher.pid)
    assert len(children) >= 2, "a gateway and a worker expected"
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=30)
    wait_until(lambda: not any(_alive(pid) for pid in children), 15, "every child to exit")


def test_killed_launcher_leaves_no_orphans(launchers):
    launcher = launchers["killed"].processes[0]
    children = _children(launcher.pid)
    assert len(children) >= 2, "a gateway and a worker expected"
    launcher.send_signal(signal.SIGKILL)
    launcher.wait(timeout=10)
    wait_until(lambda: not any(_alive(pid) for pid in children), 20, "children to die with the launcher")


def test_launcher_restarts_a_crashed_worker_then_sigterm_lets_a_running_stream_finish():
    """One ``llmpool serve`` for its life: a crashed worker comes back under its name; then SIGTERM
    mid-stream: the stream ends whole, a Responses WebSocket's response in flight ends whole and
    only then is the socket closed with 1012, the launcher exits 0, and every child with it."""
    server = start_serve("launcher-restart", 1)
    launcher = server.processes[0]
    try:
        (worker_pid,) = [
            p for p in _children(server.processes[0].pid) if "worker" in Path(f"/proc/{p}/cmdline").read_text()
        ]
        (old,) = server.workers()
        os.kill(worker_pid, signal.SIGKILL)
        # The restarted worker registers under the same name; the gateway drops the dead entry at once.
        wait_until(
            lambda: [w["identity"] for w in server.workers()] not in ([], [old["identity"]]), 180, "a restarted worker"
        )
        assert [w["name"] for w in server.workers()] == [old["name"]]
        assert (
            sdk(server)
            .chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            .choices
        )
        children = _children(launcher.pid)
        assert len(children) >= 2, "a gateway and a worker expected"
        socket = connect(server.base_url.replace("http://", "ws://") + "/v1/responses")
        body = {"model": MODEL, "input": "Tell me a story.", "max_output_tokens": 64, "ignore_eos": True}
        socket.send(json.dumps({"type": "response.create", **body}))
        while json.loads(socket.recv(60))["type"] != "response.output_text.delta":
            pass
        text, tokens = stream_text(sdk(server), lambda count: count == 5 and launcher.send_signal(signal.SIGTERM))
        assert tokens == 48 and text, "the running stream finished"
        events = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                events.append(json.loads(socket.recv(60)))
        final = events[-1]  # whole: all 64 tokens (incomplete: max_output_tokens), then the close
        assert final["type"] == "response.incomplete" and final["response"]["usage"]["output_tokens"] == 64, final
        assert closed.value.rcvd.code == 1012, closed.value
        assert launcher.wait(timeout=60) == 0
        wait_until(lambda: not any(_alive(pid) for pid in children), 15, "every child to exit")
    finally:
        server.stop()


COMPOSE_FILES = [["compose.yaml"], ["compose.yaml", "compose.gpu.yaml"], ["compose.yaml", "compose.offline.yaml"]]


@pytest.mark.parametrize("files", COMPOSE_FILES, ids=["cpu", "gpu-override", "offline-override"])
def test_compose_files_are_valid(files):
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is not installed (scripts/setup.sh --test installs it where apt-get works)")
    args = ["docker-compose"] + [a for f in files for a in ("-f", f)] + ["config", "-q"]
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_compose_services_run_as_plain_processes(postgres):
    """Run each service's command with its environment: two gateways sharing the postgres service
    (here a real PostgreSQL process), every worker connected to both, two model names. Only host
    names and ports are mapped to loopback."""
    services = yaml.safe_load((REPO / "compose.yaml").read_text())["services"]
    state_url = postgres.database("compose")
    gateways = {name: Server(free_port(), free_port()) for name in services if name.startswith("gateway")}
    assert sorted(gateways) == ["gateway-a", "gateway-b"]

    def local(env: dict[str, str], own: Server | None = None) -> dict[str, str]:
        mapped = {}
        for key, value in env.items():
            value = str(value)
            for name, server in gateways.items():
                value = value.replace(f"tcp://{name}:5555", server.zmq_address)
            if own is not None:
                value = value.replace("tcp://0.0.0.0:5555", own.zmq_address)
            mapped[key] = str(own.port) if own is not None and key == "LLMPOOL_PORT" else value
        if "LLMPOOL_STATE_URL" in mapped:
            assert "@postgres:5432/" in mapped["LLMPOOL_STATE_URL"]
            mapped["LLMPOOL_STATE_URL"] = state_url
        return mapped

    processes = []
    try:
        for name, service in services.items():
            if name == "postgres":
                continue  # the fixture's server stands in for it
            command = service["command"]
            assert command[0] == "llmpool"
            own = gateways.get(name)
            processes.append(spawn(["launcher", *command[1:]], f"compose-{name}", local(service["environment"], own)))
        models = {
            services[name]["environment"].get(
                "LLMPOOL_SERVED_MODEL_NAME", services[name]["environment"]["LLMPOOL_MODEL"]
            )
            for name in services
            if name.startswith("worker")
        }
        assert models == {MODEL, "assistant"}
        for server in gateways.values():
            server.wait_for_workers(2)
            assert {m["id"] for m in server.get("/v1/models").json()["data"]} == models
            for model in sorted(models):
                reply = sdk(server).chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                )
                assert reply.choices[0].message.content
        # One store for both: a conversation started on gateway-a goes on through gateway-b.
        first = sdk(gateways["gateway-a"]).responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
        second = sdk(gateways["gateway-b"]).responses.create(
            model=MODEL, input="And?", previous_response_id=first.id, max_output_tokens=4
        )
        assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    finally:
        for process in reversed(processes):
            stop(process)


def make_keys(folder: Path, *args: str) -> None:
    """``llmpool keys FOLDER ARGS``: CURVE key pairs for a gateway and its workers."""
    subprocess.run(
        [sys.executable, "-m", "launcher", "keys", str(folder), *args], cwd=REPO, check=True, capture_output=True
    )


def test_curve_lets_only_authorized_workers_in(tmp_path):
    keys = tmp_path / "keys"
    make_keys(keys, "--workers", "1")
    strangers = tmp_path / "strangers"
    make_keys(strangers)
    server = Server(free_port(), free_port())
    gateway_args = [
        "gateway",
        "--port",
        str(server.port),
        "--zmq-bind",
        server.zmq_address,
        "--curve-server-secret-key",
        str(keys / "gateway.key_secret"),
        "--curve-authorized-keys",
        str(keys / "authorized"),
    ]
    logs = {name: ARTIFACTS / f"{name}.log" for name in ("curve-gateway", "curve-nokeys", "curve-stranger")}
    starts = {name: path.stat().st_size if path.exists() else 0 for name, path in logs.items()}

    def logged(name: str) -> str:
        return logs[name].read_bytes()[starts[name] :].decode(errors="replace") if logs[name].exists() else ""

    server.processes.append(spawn(gateway_args, "curve-gateway", FAST_HEARTBEAT))
    try:
        # The three workers load side by side: the trusted one, one without keys, one with a key
        # the gateway does not know.
        server.processes.append(
            spawn(
                worker_argv(
                    server.zmq_address,
                    "trusted",
                    "--curve-client-secret-key",
                    str(keys / "worker-0.key_secret"),
                    "--curve-server-public-key",
                    str(keys / "gateway.key"),
                ),
                "curve-trusted",
                FAST_HEARTBEAT,
            )
        )
        server.processes.append(spawn(worker_argv(server.zmq_address, "no-keys"), "curve-nokeys", FAST_HEARTBEAT))
        server.processes.append(
            spawn(
                worker_argv(
                    server.zmq_address,
                    "unknown-key",
                    "--curve-client-secret-key",
                    str(strangers / "worker-0.key_secret"),
                    "--curve-server-public-key",
                    str(keys / "gateway.key"),
                ),
                "curve-stranger",
                FAST_HEARTBEAT,
            )
        )
        server.wait_for_workers(1)
        # Both reach the handshake and are refused, and both sides say so (not merely still loading).
        wait_until(
            lambda: "handshake with the gateway" in logged("curve-nokeys") and "refused" in logged("curve-stranger"),
            120,
            "the rogue workers to be refused",
        )
        stranger_key = (strangers / "worker-0.key").read_text().split('public-key = "')[1].split('"')[0]
        # The keyless worker's attempt is "failed: protocol error" or plain "failed" on the gateway's
        # side, depending on which end of the handshake libzmq drops first (both seen in CI).
        wait_until(
            lambda: (
                f"refused a worker's CURVE key {stranger_key}" in logged("curve-gateway")
                and re.search(r"handshake on \S+ failed", logged("curve-gateway")) is not None
            ),
            10,
            "the gateway to log both refusals",
        )
        assert "registered" not in logged("curve-nokeys") and "registered" not in logged("curve-stranger")
        assert [w["name"] for w in server.workers()] == ["trusted"]
        reply = sdk(server).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
    finally:
        server.stop()


def test_llmpool_keys_writes_secret_keys_owner_only(tmp_path):
    keys = tmp_path / "keys"
    make_keys(keys, "--workers", "2")
    secrets = sorted(p.name for p in keys.glob("*.key_secret"))
    assert secrets == ["gateway.key_secret", "worker-0.key_secret", "worker-1.key_secret"]
    for path in keys.glob("*.key_secret"):
        assert path.stat().st_mode & 0o777 == 0o600, path
    for path in [*keys.glob("*.key"), *(keys / "authorized").glob("*.key")]:
        assert path.stat().st_mode & 0o777 == 0o644, path
    assert sorted(p.name for p in (keys / "authorized").iterdir()) == ["worker-0.key", "worker-1.key"]
