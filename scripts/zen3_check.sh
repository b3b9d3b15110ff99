#!/usr/bin/env bash
# The default model served on a CPU with no AVX-512 at all (docs/cpus.md): qemu-user's EPYC-Milan
# (Zen 3: AVX2 and FMA; an AVX-512 or AVX-VNNI instruction there is SIGILL) on an x86-64 machine.
#
#   scripts/zen3_check.sh [qemu CPU model, default EPYC-Milan-v1]
#
# It starts `llmpool serve` natively for the reference answers, then a gateway natively and one
# worker under `qemu-x86_64-static -cpu <model>` with no dtype, quantization or cap (LLMPOOL_CPU_ISA,
# ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA unset): the worker reads the CPU as the emulator presents
# it (cpuid, not the host's /proc/cpuinfo), picks its kernels and dtype, runs its start-up self-check
# and serves. The greedy answers to the four prompts of tests/integration/test_cpu_cap.py must be the
# native server's, to the letter. About 12-15 min on 2 cores (the self-check's transformers forward
# is most of it: TCG emulates AVX2 through helper calls). Needs scripts/setup.sh run first; installs
# qemu-user-static with apt-get where it lacks it. Logs under test-artifacts/zen3/. Exit status
# non-zero on any difference.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_CPU=${1:-EPYC-Milan-v1}
PY=.venv/bin/python
OUT=test-artifacts/zen3
mkdir -p "$OUT"
[ "$(uname -m)" = x86_64 ] || { echo "x86-64 only" >&2; exit 2; }
if ! command -v qemu-x86_64-static >/dev/null; then
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static >/dev/null
fi
unset LLMPOOL_CPU_ISA ATEN_CPU_CAPABILITY ONEDNN_MAX_CPU_ISA
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
port() { $PY -c "from bench.servers import free_port; print(free_port())"; }

wait_ready() { # url, seconds, pid of the process that must stay up
    local deadline=$((SECONDS + $2))
    until curl -sf "$1/ready" >/dev/null; do
        kill -0 "$3" 2>/dev/null || { echo "the server died: see $OUT" >&2; exit 1; }
        [ $SECONDS -lt $deadline ] || { echo "not ready after $2 s" >&2; exit 1; }
        sleep 2
    done
}

answers() { # url -> one JSON string per prompt
    $PY - "$1" <<'EOF'
import json, sys
import httpx
from tests.integration.test_cpu_cap import MODEL, PROMPTS
for prompt in PROMPTS:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 48}
    reply = httpx.post(sys.argv[1] + "/v1/chat/completions", json=body, timeout=900)
    reply.raise_for_status()
    print(json.dumps(reply.json()["choices"][0]["message"]["content"]))
EOF
}

P=$(port)
$PY -m launcher serve --port "$P" >"$OUT/native.log" 2>&1 &
pids+=($!)
wait_ready "http://127.0.0.1:$P" 600 "${pids[-1]}"
answers "http://127.0.0.1:$P" >"$OUT/native.txt"
kill "${pids[-1]}" && wait "${pids[-1]}" 2>/dev/null || true

P=$(port) Z=$(port)
$PY -m gateway --port "$P" --zmq-bind "tcp://127.0.0.1:$Z" >"$OUT/gateway.log" 2>&1 &
pids+=($!)
start=$SECONDS
qemu-x86_64-static -cpu "$MODEL_CPU" $PY -m worker --gateway-address "tcp://127.0.0.1:$Z" >"$OUT/worker.log" 2>&1 &
pids+=($!)
wait_ready "http://127.0.0.1:$P" 3600 "${pids[-1]}"
echo "emulated $MODEL_CPU worker ready after $((SECONDS - start)) s"
grep -E "worker.runner.choices: CPU|self-check" "$OUT/worker.log" | sed 's/^.*INFO //'
start=$SECONDS
answers "http://127.0.0.1:$P" >"$OUT/emulated.txt"
echo "four answers in $((SECONDS - start)) s"
if diff "$OUT/native.txt" "$OUT/emulated.txt"; then
    echo "the same greedy text as the native server, 4 of 4:"
    cat "$OUT/native.txt"
else
    echo "the answers differ (native <, emulated >)" >&2
    exit 1
fi
