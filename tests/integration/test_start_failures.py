"""A worker that cannot serve its model: the refusal reaches the launcher, which gives up instead of
restarting it forever, and the gateway's /health, which says what is failing instead of "ok"."""

from __future__ import annotations

import re
import subprocess

import pytest

from launcher.cli import Child, Supervisor, build_parser
from tests.conftest import ARTIFACTS, free_port, spawn, stop, wait_until, worker_argv
from tests.worker.families import REFUSED, build
from worker.config import EXIT_UNSUPPORTED

REFUSAL = "MambaForCausalLM (model type 'mamba') is not supported"


@pytest.fixture(scope="module")
def mamba(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("mamba")
    model_type, extra, _ = REFUSED["mamba"]
    build(model_type, extra, folder)
    return str(folder)


def test_the_launcher_gives_up_on_a_refused_model_with_its_reason(mamba):
    args = [
        "launcher",
        "serve",
        "--model",
        mamba,
        "--port",
        str(free_port()),
        "--zmq-bind",
        f"tcp://127.0.0.1:{free_port()}",
    ]
    (ARTIFACTS / "start-failure-launcher.log").unlink(missing_ok=True)  # spawn appends; read this run only
    launcher = spawn(args, "start-failure-launcher")
    try:
        assert launcher.wait(timeout=180) == 1
    except subprocess.TimeoutExpired:
        stop(launcher)
        raise
    log = (ARTIFACTS / "start-failure-launcher.log").read_text()
    assert "restarting in" not in log
    assert re.search(
        f"worker-0 cannot serve this model with these settings; not restarting it: {re.escape(REFUSAL)}", log
    )
    assert re.search(f"no worker could start; stopping: {re.escape(REFUSAL)}", log)


def test_health_says_which_worker_cannot_start_and_why(server, mamba):
    worker = spawn(
        worker_argv(server.zmq_address, "mamba-worker", "--model", mamba),
        "start-failure-worker",
    )
    assert worker.wait(timeout=180) == EXIT_UNSUPPORTED
    wait_until(lambda: server.get("/health").json()["status"] == "degraded", 10, "/health to report the failed worker")
    health = server.get("/health")
    assert health.status_code == 200  # the liveness probe: restarting the gateway would mend nothing
    (failure,) = [f for f in health.json()["failing"] if f["worker"] == "mamba-worker"]
    assert failure["error"].startswith(REFUSAL)


class _Exited:
    """A child process that exited with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


def test_a_failing_worker_is_restarted_with_backoff_then_given_up(monkeypatch):
    supervisor = Supervisor(build_parser().parse_args(["serve", "--worker-start-tries", "3"]))
    worker = supervisor.workers[0]
    starts: list[float] = []
    monkeypatch.setattr(Child, "start", lambda child: (starts.append(now), setattr(child, "restart_at", None)))
    worker.process, worker.last_error = _Exited(1), "OSError: disk full"
    now = 0.0
    for now in (0.0, 0.5, 1.0, 1.5, 3.4, 3.5):  # exits at 0: restart 1 s later; exits at 1.5: restart 2 s later
        supervisor._watch(worker, now)
    assert starts == [1.0, 3.5] and not worker.given_up
    supervisor._watch(worker, 3.6)  # the third failed start in a row
    assert worker.given_up and worker.failed_starts == 3
    refused = Child("w", "worker", {}, process=_Exited(EXIT_UNSUPPORTED))
    supervisor._watch(refused, 0.0)
    assert refused.given_up and refused.failed_starts == 1  # a refusal is not retried
