"""The default model served with no dtype or quantization flags, and again under the AVX2 cap
(LLMPOOL_CPU_ISA=avx2 with torch's own twins, as a user on a mixed fleet or an AVX2-only server runs
it): ready, answering, and the same greedy text as the shared uncapped server. On an AVX2-only CPU
both are the avx2 variant; on aarch64 the cap is the portable variant's name there (neon's own)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import ARTIFACTS, Server, start_serve
from worker import cpu

CAP = {"x86_64": {"LLMPOOL_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}.get(
    cpu.arch(), {"LLMPOOL_CPU_ISA": "neon"}
)
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Say hello in one short sentence.",
    "What is the capital of France? Answer briefly.",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def capped() -> Iterator[Server]:
    if not any(v.name == CAP["LLMPOOL_CPU_ISA"] for v in cpu.runnable()):
        pytest.skip(f"this CPU cannot run the {CAP['LLMPOOL_CPU_ISA']} kernels")
    server = start_serve("serve-cpu-cap", 1, env=CAP)
    yield server
    server.stop()


def greedy(server: Server, prompt: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 48}
    reply = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_the_capped_server_is_ready_and_names_its_kernels(capped):
    assert httpx.get(capped.base_url + "/ready", timeout=10).status_code == 200
    log = (ARTIFACTS / "serve-cpu-cap.log").read_text()
    assert f"kernels {CAP['LLMPOOL_CPU_ISA']} (LLMPOOL_CPU_ISA={CAP['LLMPOOL_CPU_ISA']})" in log


@pytest.mark.parametrize("prompt", PROMPTS)
def test_the_capped_server_gives_the_same_greedy_text(server, capped, prompt):
    """The default path on a CPU (a GGUF: every batch through the C++ step in float32) adds in the
    same order on every variant, so the cap changes no token."""
    assert greedy(capped, prompt) == greedy(server, prompt)
