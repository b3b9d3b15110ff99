"""``llmpool serve|gateway|worker|keys|kv-store``.

``serve`` starts the gateway and ``--workers N`` local workers of each model (``--model``, or each
entry of ``--models``) as child processes and supervises them: each child gets its settings through the flags' environment twins (one definition per flag),
a worker that dies is restarted, SIGINT/SIGTERM stops everything, and every child is set to die
with the launcher (PR_SET_PDEATHSIG), so nothing is orphaned even if the launcher is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from common.config import Flag, add_flags, flags_to_env
from common.logs import setup_logging
from gateway.config import ALL_GATEWAY_FLAGS
from worker.config import ALL_WORKER_FLAGS

log = logging.getLogger("launcher")

LAUNCHER_FLAGS = [
    Flag("workers", 1, "Local worker processes to start, per model", int),
    Flag(
        "models",
        None,
        "Several models on this machine, comma-separated, each NAME=MODEL (MODEL as for --model), e.g. "
        "smol=SmolLM2-135M-Instruct,other=/models/other; --workers N workers each. Default: just --model",
    ),
    Flag("kill-after", 45.0, "Seconds children get to drain and exit after SIGTERM before SIGKILL", float),
]
_SERVE_WORKER_FLAGS = [f for f in ALL_WORKER_FLAGS if f not in ALL_GATEWAY_FLAGS and f.name != "gateway-address"]
_PR_SET_PDEATHSIG = 1


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

    def start(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", self.module], env=self.env, preexec_fn=_die_with_parent)
        log.info("started %s (pid %d)", self.name, self.process.pid)


class Supervisor:
    """Starts the children, restarts workers that die, stops everything on a signal."""

    def __init__(self, args: argparse.Namespace) -> None:
        base = dict(os.environ)
        gateway_env = {**base, **flags_to_env(args, ALL_GATEWAY_FLAGS)}
        worker_env = {**base, **flags_to_env(args, ALL_GATEWAY_FLAGS), **flags_to_env(args, _SERVE_WORKER_FLAGS)}
        worker_env["LLMPOOL_GATEWAY_ADDRESS"] = connect_address(args.zmq_bind)
        models = parse_models(args.models)
        if args.threads == 0:  # share the cores between the local workers
            worker_env["LLMPOOL_THREADS"] = str(max(1, (os.cpu_count() or 1) // (args.workers * max(1, len(models)))))
        self.gateway = Child("gateway", "gateway", gateway_env)
        self.workers = []
        for served, model in models or [(None, None)]:
            prefix = f"{served}-worker" if served else "worker"
            env = {**worker_env, **({"LLMPOOL_MODEL": model, "LLMPOOL_SERVED_MODEL_NAME": served} if served else {})}
            self.workers += [Child(f"{prefix}-{i}", "worker", {**env, "LLMPOOL_WORKER_NAME": f"{prefix}-{i}"}) for i in range(args.workers)]
        self.grace = args.kill_after
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
                if worker.process.poll() is not None and not self.stopping:
                    worker.restarts += 1
                    log.warning("%s exited with code %s; restarting (restart %d)", worker.name, worker.process.returncode, worker.restarts)
                    worker.start()
        self.stop()
        return code

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
    keys = commands.add_parser("keys", help="make CURVE key pairs for the gateway and workers")
    keys.add_argument("folder", help="where to write gateway.key(_secret) and worker-N.key(_secret)")
    keys.add_argument("--workers", type=int, default=1, help="worker key pairs to make")
    store = commands.add_parser("kv-store", help="what a KV store (--kv-store) holds, or empty it")
    store.add_argument("action", choices=["stats", "clear"], help="stats: blocks and bytes per model fingerprint (JSON); clear: remove every block")
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
    print(f"worker N: --curve-client-secret-key {folder}/worker-N.key_secret --curve-server-public-key {folder}/gateway.key")


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
