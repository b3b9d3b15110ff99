"""Two live workers with one --worker-name: the second is refused at registration, with the reason
logged on both sides, and the first keeps its registration (issue 25: the gateway re-registered the
pair 45 times in 131 s, moving in-flight requests each time). When the first dies, the second takes
its place. Model-less workers (bench/fake_worker.py runs worker.proc's real DEALER loop)."""

from __future__ import annotations

import signal

from tests.conftest import ARTIFACTS, Server, free_port, spawn, wait_until, worker_argv

BEATS = ["--heartbeat-interval", "0.5", "--heartbeat-liveness", "3"]


def log_count(name: str, text: str) -> int:
    path = ARTIFACTS / f"{name}.log"
    return path.read_text(errors="replace").count(text) if path.exists() else 0


def test_a_second_worker_with_a_taken_name_is_refused_not_flapped(tmp_path):
    for name in ("names-gateway", "names-first", "names-second"):
        (ARTIFACTS / f"{name}.log").unlink(missing_ok=True)
    server = Server(free_port(), free_port())
    server.processes.append(
        spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address, *BEATS], "names-gateway")
    )
    worker = worker_argv(server.zmq_address, "twin", *BEATS, fake_info=tmp_path / "info")
    try:
        first = spawn(worker, "names-first")
        server.processes.append(first)
        server.wait_for_workers(1, timeout=120)
        identity = server.workers()[0]["identity"]
        server.processes.append(spawn(worker, "names-second"))
        refusal = "the gateway refused to register this worker: another live worker is registered as 'twin'"
        # It retries after each refusal (the link stays silent, then backoff): wait for the second try.
        wait_until(lambda: log_count("names-second", refusal) >= 2, 60, "the second worker's second refusal")
        assert (
            log_count("names-gateway", "refused worker twin: another live worker is registered as 'twin'") == 1
        )  # said once
        snapshot = server.get("/workers").json()
        assert [w["identity"] for w in snapshot["workers"]] == [identity] and snapshot["departures"] == 0, snapshot

        first.send_signal(signal.SIGKILL)  # a dead holder frees the name: the second registers on its next try
        wait_until(
            lambda: [w["identity"] for w in server.workers()] not in ([], [identity]),
            60,
            "the second worker to register",
        )
        assert server.workers()[0]["name"] == "twin"
    finally:
        server.stop()
