#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer `python -m bench --peer` compares against, and
# llama-quantize (bench/gguf_1b.py makes the 1B shape's GGUF files with it), from the
# llama.cpp copy vendored in PyPI's llama-cpp-python sdist (only package registries are reachable
# here, and a pinned sdist is a pinned llama.cpp). Nothing is committed: the sdist, the sources and
# the binary stay under .llama.cpp/ (git-ignored).
#
#   bench/build_llama_server.sh            # -> .llama.cpp/build/bin/llama-server
#   JOBS=4 bench/build_llama_server.sh     # more compile jobs (default 2, niced: the cores are shared)
#   ISA=avx2 bench/build_llama_server.sh   # -> .llama.cpp/build-avx2/bin/llama-server: AVX2 + FMA + F16C only,
#                                          # the peer for llmpool under LLMPOOL_CPU_ISA=avx2 on a newer CPU
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${LLAMA_DIR:-$ROOT/.llama.cpp}"
JOBS="${JOBS:-2}"
PIP="${PIP:-$ROOT/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"

command -v cmake >/dev/null || { echo "cmake is missing: apt-get install -y cmake" >&2; exit 1; }
mkdir -p "$DIR"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  $PIP download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$DIR"  # the build tools it needs come as wheels
fi
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -d "$SRC" ] || tar -xzf "$SDIST" -C "$DIR"

# ggml's AMX matmul (compiled in by -march=native on a CPU with AMX) crashed this project's VMs with a
# general-protection fault in ggml_backend_amx_mul_mat at warm-up (Sapphire Rapids, 2026-11-26), so
# it is left out; llama.cpp then runs its AVX-512 VNNI/BF16 kernels, as on CPUs without AMX.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILD="$DIR/build"
ISA_FLAGS=(-DGGML_NATIVE=ON)
if [ "${ISA:-native}" = avx2 ]; then  # x86-64-v3 as an AVX2-only server (Zen 3, Haswell) has it, nothing newer
  BUILD="$DIR/build-avx2"
  ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_INT8=OFF)
fi
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON \
  "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX"
nice -n 10 cmake --build "$BUILD" --target llama-server llama-quantize -j "$JOBS"
echo "built $BUILD/bin/llama-server and llama-quantize"
