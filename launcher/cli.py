"""``llmpool serve|gateway|worker|keys|kv-store`` (``keys create|list|...``: launcher/api_keys.py).

``serve`` starts the gateway and ``--workers N`` local workers of each model (``--model``, or each
entry of ``--models``) as child processes and supervises them: each child gets its settings through the flags' environment twins (one definition per flag),
a worker that dies is restarted, SIGINT/SIGTERM stops everything, and every child is set to die
with the launcher (PR_SET_PDEATHSIG), so nothing is orphaned even if the launcher is killed.

A worker that cannot start is restarted after 1, 2, 4... s (at most 30), and given up after
``--worker-start-tries`` failed starts in a row, or at once when it refused its model (exit code
``EXIT_UNSUPPORTED``: restarting cannot help); its own error line is repeated when it is given up.
When no worker is left the launcher stops with that error.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO

from common.config import Flag, add_flags, flags_to_env
from common.logs import setup_logging
from gateway.config import ALL_GATEWAY_FLAGS
from worker.config import ALL_WORKER_FLAGS, EXIT_UNSUPPORTED
from worker.threads import team_size

log = logging.getLogger(__name__)

LAUNCHER_FLAGS = [
    Flag("workers", 1, "Local worker processes to start, per model", int),
    Flag(
        "models",
        None,
        "Several models on this machine, comma-separated, each NAME=MODEL (MODEL as for --model), e.g. "
        "smol=SmolLM2-135M-Instruct,other=/models/other; --workers N workers each. Default: just --model",
    ),
    Flag("kill-after", 45.0, "Seconds children get to drain and exit after SIGTERM before SIGKILL", float),
    Flag(
        "worker-start-tries",
        4,
        "Starts in a row a worker may fail (exit before it is ready) before the launcher gives up on it; restarts wait 1, 2, 4... s "
        "(at most 30). A worker that refuses its model is not restarted",
        int,
    ),
]
MAX_RESTART_DELAY_S = 30.0
_SERVE_WORKER_FLAGS = [f for f in ALL_WORKER_FLAGS if f not in ALL_GATEWAY_FLAGS and f.name != "gateway-address"]
_PR_SET_PDEATHSIG = 1
API_KEY_ACTIONS = ("create", "list", "get", "update", "revoke")  # launcher/api_keys.py; else CURVE's FOLDER


def _die_with_parent() -> None:
    """Runs in the child before exec: ask the kernel to SIGTERM it when the launcher goes away."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def connect_address(bind: str) -> str:
    """Where a local worker connects for a given bind address (a wildcard host becomes loopback)."""
    return bind.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")


@dataclass
class Child:
    name: str
    module: str
    env: dict[str, str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    failed_starts: int = 0  # exits in a row before it was ready
    ready: bool = False  # its log said it is ready (this run)
    last_error: str = ""  # its last "cannot start" line
    restart_at: float | None = None
    given_up: bool = False

    def start(self) -> None:
        """Run it; a worker's stderr is relayed line by line (read for readiness and its error)."""
        relay = self.module == "worker"
        self.ready, self.restart_at = False, None
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module],
            env=self.env,
            preexec_fn=_die_with_parent,
            stderr=subprocess.PIPE if relay else None,
        )
        if relay:
            threading.Thread(
                target=self._relay, args=(self.process.stderr,), name=f"{self.name}-stderr", daemon=True
            ).start()
        log.info("started %s (pid %d)", self.name, self.process.pid)

    def _relay(self, stream: IO[bytes]) -> None:
        for line in iter(stream.readline, b""):
            sys.stderr.buffer.write(line)
            sys.stderr.buffer.flush()
            text = line.decode(errors="replace").strip()
            try:
                text = json.loads(text).get("message", text)  # --log-format json
            except (ValueError, AttributeError):
                pass
            if "worker ready:" in text:
                self.ready = True
            elif "cannot start: " in text:
                self.last_error = text.split("cannot start: ", 1)[1]


class Supervisor:
    """Starts the children, restarts workers that die, stops everything on a signal."""

    def __init__(self, args: argparse.Namespace) -> None:
        base = dict(os.environ)
        gateway_env = {**base, **flags_to_env(args, ALL_GATEWAY_FLAGS)}
        gateway_env["LLMPOOL_CACHE_DIR"] = args.cache_dir  # the default state store lives there too (--state-url)
        worker_env = {**base, **flags_to_env(args, ALL_GATEWAY_FLAGS), **flags_to_env(args, _SERVE_WORKER_FLAGS)}
        worker_env["LLMPOOL_GATEWAY_ADDRESS"] = connect_address(args.zmq_bind)
        models = parse_models(args.models)
        if args.threads == 0:  # share the cores between the local workers
            worker_env["LLMPOOL_THREADS"] = str(team_size(0, share=args.workers * max(1, len(models))))
        self.gateway = Child("gateway", "gateway", gateway_env)
        self.workers = []
        for served, model in models or [(None, None)]:
            prefix = f"{served}-worker" if served else "worker"
            env = {**worker_env, **({"LLMPOOL_MODEL": model, "LLMPOOL_SERVED_MODEL_NAME": served} if served else {})}
            self.workers += [  # the list's length: the workers of the models before this one
                Child(
                    f"{prefix}-{i}",
                    "worker",
                    {**env, "LLMPOOL_WORKER_NAME": f"{prefix}-{i}", **_own_events(env, len(self.workers) + i)},
                )
                for i in range(args.workers)
            ]
        self.grace = args.kill_after
        self.tries = max(1, args.worker_start_tries)
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        for child in (self.gateway, *self.workers):
            child.start()
        code = 0
        while not self.stopping:
            time.sleep(0.2)
            if self.gateway.process.poll() is not None:
                log.error("the gateway exited with code %s; stopping", self.gateway.process.returncode)
                code = 1
                break
            for worker in self.workers:
                self._watch(worker, time.monotonic())
            if all(worker.given_up for worker in self.workers):
                errors = sorted({w.last_error for w in self.workers if w.last_error}) or ["see the workers' log above"]
                log.error("no worker could start; stopping: %s", "; ".join(errors))
                code = 1
                break
        self.stop()
        return code

    def _watch(self, worker: Child, now: float) -> None:
        """Restart a worker that exited, after a backoff, unless it is given up."""
        if worker.given_up or self.stopping:
            return
        if worker.restart_at is not None:
            if now >= worker.restart_at:
                worker.start()
            return
        returncode = worker.process.poll()
        if returncode is None:
            return
        worker.failed_starts = 0 if worker.ready else worker.failed_starts + 1
        why = f": {worker.last_error}" if worker.last_error and not worker.ready else ""
        if returncode == EXIT_UNSUPPORTED:
            worker.given_up = True
            log.error("%s cannot serve this model with these settings; not restarting it%s", worker.name, why)
        elif worker.failed_starts >= self.tries:
            worker.given_up = True
            log.error("%s failed to start %d times in a row; giving up on it%s", worker.name, worker.failed_starts, why)
        else:
            delay = min(MAX_RESTART_DELAY_S, 2.0 ** max(0, worker.failed_starts - 1))
            worker.restarts += 1
            worker.restart_at = now + delay
            log.warning(
                "%s exited with code %s%s; restarting in %.0f s (restart %d)",
                worker.name,
                returncode,
                why,
                delay,
                worker.restarts,
            )

    def stop(self) -> None:
        children = [c.process for c in (*self.workers, self.gateway) if c.process and c.process.poll() is None]
        for process in children:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for process in children:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("pid %d ignored SIGTERM; killing it", process.pid)
                process.kill()
                process.wait()
        log.info("stopped")


def parse_models(spec: str | None) -> list[tuple[str, str]]:
    """``--models`` as (served name, model) pairs; [] when not given."""
    pairs = []
    for entry in (e.strip() for e in (spec or "").split(",")):
        if not entry:
            continue
        name, sep, model = entry.partition("=")
        if not sep or not name.strip() or not model.strip():
            raise SystemExit(f"--models: {entry!r} is not NAME=MODEL")
        pairs.append((name.strip(), model.strip()))
    return pairs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmpool", description="OpenAI-compatible gateway over a ZeroMQ worker pool")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="the gateway and --workers N local workers")
    add_flags(serve, "launcher", LAUNCHER_FLAGS)
    add_flags(serve, "gateway", ALL_GATEWAY_FLAGS)
    add_flags(serve, "worker", _SERVE_WORKER_FLAGS)
    commands.add_parser("gateway", help="the gateway alone (flags: llmpool gateway --help)", add_help=False)
    commands.add_parser("worker", help="one worker alone (flags: llmpool worker --help)", add_help=False)
    keys = commands.add_parser(
        "keys", help="make CURVE key pairs (FOLDER); or managed API keys: keys create|list|get|update|revoke --help"
    )
    keys.add_argument("folder", help="where to write gateway.key(_secret) and worker-N.key(_secret)")
    keys.add_argument("--workers", type=int, default=1, help="worker key pairs to make")
    store = commands.add_parser("kv-store", help="what a KV store (--kv-store) holds, or empty it")
    store.add_argument(
        "action",
        choices=["stats", "clear"],
        help="stats: blocks and bytes per model fingerprint (JSON); clear: remove every block",
    )
    store.add_argument("store", help="the store: a folder, or redis://HOST:PORT/DB")
    return parser


def make_keys(folder: str, workers: int) -> None:
    """gateway.key / gateway.key_secret and worker-N pairs; put the workers' public files in the
    gateway's --curve-authorized-keys folder (done here: FOLDER/authorized). Secret files are
    created owner-only (0600: never readable by others, not even for a moment); public ones 0644."""
    import shutil

    import zmq.auth

    previous = os.umask(0o077)
    try:
        os.makedirs(os.path.join(folder, "authorized"), exist_ok=True)
        publics = [zmq.auth.create_certificates(folder, "gateway")[0]]
        for i in range(workers):
            public, _ = zmq.auth.create_certificates(folder, f"worker-{i}")
            publics.append(public)
            publics.append(shutil.copy(public, os.path.join(folder, "authorized")))
    finally:
        os.umask(previous)
    for path in publics:
        os.chmod(path, 0o644)
    print(f"gateway: --curve-server-secret-key {folder}/gateway.key_secret --curve-authorized-keys {folder}/authorized")
    print(
        f"worker N: --curve-client-secret-key {folder}/worker-N.key_secret --curve-server-public-key {folder}/gateway.key"
    )


def kv_store(action: str, store: str) -> None:
    """``llmpool kv-store stats|clear STORE`` (worker/kv_store/admin.py)."""
    import json

    from worker.kv_store import admin

    if action == "stats":
        print(json.dumps(admin.stats(store), indent=2))
    else:
        print(f"removed {admin.clear(store)} blocks from {store}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gateway"]:
        from gateway.__main__ import main as gateway_main

        gateway_main(argv[1:])
        return
    if argv[:1] == ["keys"] and argv[1:2] and argv[1] in API_KEY_ACTIONS:
        from launcher import api_keys

        api_keys.main(argv[1:])
        return
    if argv[:1] == ["worker"]:
        from worker.__main__ import main as worker_main

        worker_main(argv[1:])
        return
    args = build_parser().parse_args(argv)
    if args.command == "keys":
        make_keys(args.folder, args.workers)
        return
    if args.command == "kv-store":
        kv_store(args.action, args.store)
        return
    setup_logging("launcher", args.log_level, args.log_format)
    sys.exit(Supervisor(args).run())


def _own_events(env: dict[str, str], index: int) -> dict[str, str]:
    """Each local worker its own bound KV-events ports (--kv-events-endpoint tcp://*:5557: worker 0 on
    5557, worker 1 on 5558, ...; the replay endpoint likewise), as vLLM offsets them by data-parallel
    rank; others are as given."""
    own = {}
    for name in ("LLMPOOL_KV_EVENTS_ENDPOINT", "LLMPOOL_KV_EVENTS_REPLAY_ENDPOINT"):
        host, _, port = env.get(name, "").rpartition(":")
        if index and host.startswith("tcp://") and "*" in host and port.isdigit():
            own[name] = f"{host}:{int(port) + index}"
    return own
