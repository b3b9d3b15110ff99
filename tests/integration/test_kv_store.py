"""The KV store with real processes: a worker restarted by the launcher (a deploy, a crash) serves a
long prompt from the store its predecessor wrote, with the same greedy answer (float32) and the
prompt counted as cached; the figures reach /workers and /metrics; ``llmpool kv-store`` reads and
empties the folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Server, start_serve, wait_until
from tests.integration.test_processes import _children

SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly, without lists. " * 12  # ~200 tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Server, Path]:
    store = tmp_path_factory.mktemp("kv-store")
    server = start_serve("serve-kv-store", 1, "--kv-store", str(store), "--dtype", "float32", "--max-model-len", "1024")
    yield server, store
    server.stop()


def ask(server: Server, question: str) -> dict:
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }
    response = server.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct", **body})
    assert response.status_code == 200, response.text
    return response.json()


def kv_store_cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "launcher", "kv-store", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_restarted_worker_answers_from_the_store(served):
    server, store = served
    first = ask(server, "What is a river?")
    prompt_tokens = first["usage"]["prompt_tokens"]
    full_blocks = prompt_tokens // 16
    wait_until(
        lambda: json.loads(kv_store_cli("stats", str(store)))["blocks"] == full_blocks,
        60,
        "the prompt's blocks in the store",
    )
    wait_until(lambda: server.workers()[0]["kv_store_written_bytes"] > 0, 20, "the bytes written in a heartbeat")
    (old,) = server.workers()

    (worker_pid,) = [
        p for p in _children(server.processes[0].pid) if "worker" in Path(f"/proc/{p}/cmdline").read_text()
    ]
    os.kill(worker_pid, signal.SIGTERM)  # drains, leaves; the launcher starts another, with an empty prefix cache
    wait_until(
        lambda: [w["identity"] for w in server.workers()] not in ([], [old["identity"]]), 120, "the restarted worker"
    )

    again = ask(server, "What is a river?")
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    wait_until(lambda: server.workers()[0]["kv_store_hits"] == (prompt_tokens - 1) // 16, 20, "the hits in a heartbeat")
    (worker,) = server.workers()
    assert worker["kv_store_id"] == old["kv_store_id"] != "" and worker["kv_store_read_bytes"] > 0
    metrics = server.get("/metrics").text
    assert (
        f'llmpool_worker_kv_store_hit_blocks_total{{model="SmolLM2-135M-Instruct",worker="worker-0"}} {(prompt_tokens - 1) // 16}.0'
        in metrics
    )

    assert kv_store_cli("clear", str(store)).startswith(f"removed {full_blocks} blocks")
    assert json.loads(kv_store_cli("stats", str(store)))["blocks"] == 0
