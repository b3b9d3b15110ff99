#!/usr/bin/env bash
# bench/gpu.sh [OUT] [STEP...]: the GPU checks and benchmarks in one command, on a machine with one
# CUDA GPU and the project's dependencies importable (no network needed: the 1B-class Llama is built
# from a config with random weights, bench/random_llama.py).
#
# Steps (all by default): tests (tests/gpu and the attention kernels' tests), families (the model
# families' exactness tests, tests/worker/test_families.py, on the GPU), kernels (one layer's
# decode attention by backend: bench/attention_kernels.py), decode (batch-1 decode
# time per token against the HBM bandwidth limit, CUDA graphs on and off, kernels per layer: bench/gpu_decode.py),
# chat (python -m bench at 1, 8, 32, 64 and 256 streams, CUDA graphs on and off), random (1,024-token
# prompts, 128 out, at 1, 8 and 32 streams: TTFT), long (one stream at a 4,096-token context).
# Models: $GPU_MODELS (default: the default model, if its package is installed, and the 1B Llama).
# Decode attention: the Triton kernel, and FlashInfer too where it imports (servers with graphs on).
# Results: OUT/*.json, *.md and logs (default bench-results/gpu).
set -u -o pipefail
OUT=$(realpath -m "${1:-bench-results/gpu}")
shift || true
STEPS=${*:-tests families kernels decode chat random long}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cd "$REPO"

LLAMA_1B=${LLAMA_1B:-$OUT/models/llama-1b}
"$PY" -m bench.random_llama "$LLAMA_1B" --size 1b ${TOKENIZER:+--tokenizer "$TOKENIZER"} >/dev/null || exit 1
if [ -z "${GPU_MODELS:-}" ]; then
    GPU_MODELS=$LLAMA_1B
    "$PY" -c "from common.model_source import resolve_model; resolve_model('SmolLM2-135M-Instruct')" 2>/dev/null && GPU_MODELS="SmolLM2-135M-Instruct $GPU_MODELS"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

# (attention, graphs) pairs of the served runs: graphs on and off with the Triton kernel; FlashInfer with graphs.
RUNS="triton:on triton:off"
"$PY" -c "import flashinfer" 2>/dev/null && RUNS="$RUNS flashinfer:on"
echo "runs: $RUNS" | tee -a "$OUT/gpu.txt"

served_args() {  # a GPU worker with its defaults (256 sequences, an 8,192-token step budget)
    echo "--model $1 --device cuda $2"
}
label() { basename "$1"; }

for step in $STEPS; do
    echo "== $step ($(date -u +%T))"
    case $step in
    tests)
        only=()
        case " $GPU_MODELS " in *" $LLAMA_1B "*) ;; *) only=(-k "not llama-1b") ;; esac
        LLMPOOL_TEST_LLAMA_1B=$LLAMA_1B LLMPOOL_TEST_TOKENIZER=${TOKENIZER:-} timeout 540 "$PY" -m pytest -q -rA -p no:cacheprovider \
            "${only[@]}" tests/gpu tests/worker/test_triton_attention.py tests/worker/test_flashinfer_attention.py 2>&1 | tee "$OUT/tests.log" | tail -40
        ;;
    families)
        LLMPOOL_TEST_DEVICE=cuda timeout 300 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/worker/test_families.py 2>&1 |
            tee "$OUT/families.log" | tail -30
        ;;
    kernels)
        timeout 300 "$PY" -m bench.attention_kernels --out "$OUT/attention.json" 2>&1 | grep -v Warning | tail -12
        ;;
    decode)
        timeout 300 "$PY" -m bench.gpu_decode $GPU_MODELS --out "$OUT/decode.json" 2>&1 | grep -v Warning | tail -12
        ;;
    chat | random | long)
        for model in $GPU_MODELS; do
            # The server loads the model by this spec and serves it under its basename; a folder is
            # served by its name, so run from its parent for `--model NAME` to find the tokenizer too.
            dir=.
            name=$model
            if [ -d "$model" ]; then dir=$(dirname "$model") name=$(basename "$model"); fi
            for run in $RUNS; do
                attention=${run%:*} graphs=${run#*:}
                case $step in
                chat) work="--workload chat --concurrency 1,8,32,64,256" ;;
                random) work="--workload random --input-len 1024 --output-len 128 --concurrency 1,8,32" ;;
                long) work="--workload long-context --input-len 4096 --num-prompts 3" ;;
                esac
                [ "$step" != chat ] && [ "$graphs" = off ] && continue # graphs on/off: the chat levels say it
                tag=$attention-graphs-$graphs
                (cd "$dir" && PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" timeout 420 "$PY" -m bench $work --model "$name" \
                    --server-arg "$(served_args "$name" "--cuda-graphs $graphs --cuda-attention $attention")" --label "llmpool-$tag" \
                    --out "$OUT/$step-$(label "$model")-$tag") 2>&1 | grep -E "^\| llmpool|^concurrency|Error|error" | tail -12
            done
        done
        ;;
    *) echo "unknown step $step" ;;
    esac
done
echo "== done ($(date -u +%T)); results in $OUT"
