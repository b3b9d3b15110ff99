"""Compiling one kernel variant into its library: the sources copied into a folder keyed by their
contents, the variant's flags and the torch installation, each source compiled in parallel (an
object kept per source, headers and flags, so an edit to one file recompiles that file), linked,
and renamed into place whole, under a lock (two workers starting together build once).

Its own few lines instead of torch.utils.cpp_extension.load: that one always loads what it built,
and a library for instructions this CPU lacks must be built (an image carries every variant of its
architecture) but never loaded.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.utils import cpp_extension

from worker.cpu import Variant

FOLDER = Path(__file__).parent
SOURCES = ("ops.cpp", "attention.cpp", "gemm.cpp", "packed.cpp", "decode_step.cpp", "sampling.cpp")
HEADERS = ("vec.h", "gemm.h", "attention.h", "ops.h", "isa_avx512.h", "isa_avx2.h", "isa_neon.h", "isa_portable.h")
CFLAGS = ("-O3", "-ffp-contract=fast", "-fvisibility=hidden", "-fPIC", "-std=c++20")
TORCH_LIB = Path(torch.__file__).parent / "lib"


def namespace(variant: Variant) -> str:
    """The torch.ops namespace of a variant's ops."""
    return f"llmpool_{variant.name}"


def _openmp() -> tuple[list[str], list[str]]:
    """(compile, link) flags for OpenMP, which at::parallel_for's inline code uses: GCC's, or on macOS
    the libomp torch ships where it does (Apple clang has none: then the kernels run on one thread)."""
    if platform.system() != "Darwin":
        return ["-fopenmp"], ["-fopenmp"]
    if (TORCH_LIB / "libomp.dylib").is_file() and (TORCH_LIB.parent / "include" / "omp.h").is_file():
        return ["-Xpreprocessor", "-fopenmp"], [f"-L{TORCH_LIB}", "-lomp"]
    return [], []


def flags(variant: Variant) -> list[str]:
    includes = [f"-isystem{path}" for path in cpp_extension.include_paths()]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [
        *CFLAGS,
        *_openmp()[0],
        *variant.cflags,
        abi,
        f"-DLLMPOOL_VARIANT={variant.name}",
        f"-DLLMPOOL_OPS={namespace(variant)}",
        *includes,
    ]


def build_dir(variant: Variant) -> Path:
    """One folder per sources, flags and torch installation. The flags name the variant's instruction
    sets, never the build machine's, so a cache moved to another CPU (a worker pod's volume on a new
    node) stays valid: the loader picks by the CPU, not by what was built."""
    root = os.environ.get("LLMPOOL_KERNEL_DIR") or Path.home() / ".cache" / "llmpool" / "kernels"
    files = [(FOLDER / name).read_bytes() for name in (*SOURCES, *HEADERS)]
    parts = [*files, " ".join(flags(variant)).encode(), str(TORCH_LIB).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]
    return Path(root) / f"torch-{torch.__version__}-{variant.name}-{key}"


def library(variant: Variant) -> Path:
    return build_dir(variant) / f"llmpool_cpu_{variant.name}.so"


def compile_variant(variant: Variant, jobs: int | None = None) -> Path:
    """The variant's library, compiled first if this folder has none (~40-80 s on 2 cores)."""
    target = library(variant)
    if target.is_file():
        return target
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():  # built by another process while this one waited
            return target
        for name in (*SOURCES, *HEADERS):
            shutil.copyfile(FOLDER / name, folder / name)
        compiler = os.environ.get("CXX") or "c++"
        command = [compiler, *flags(variant)]

        objects_dir = folder.parent / f"objects-{variant.name}"
        objects_dir.mkdir(exist_ok=True)
        headers = b"".join((FOLDER / name).read_bytes() for name in HEADERS)

        def one(source: str) -> Path:
            key = hashlib.sha256(b"\0".join([(FOLDER / source).read_bytes(), headers, " ".join(command).encode()]))
            out = objects_dir / f"{Path(source).stem}-{key.hexdigest()[:12]}.o"
            if out.is_file():
                return out
            partial = out.with_suffix(".partial.o")
            run = subprocess.run(
                [*command, "-c", str(folder / source), "-o", str(partial)], capture_output=True, text=True
            )
            if run.returncode:
                raise RuntimeError(f"{source} ({variant.name}) did not compile:\n{run.stderr[-4000:]}")
            partial.rename(out)
            return out

        with ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
            objects = list(pool.map(one, SOURCES))
        partial = folder / f"{target.name}.partial"
        link = [compiler, "-shared", *map(str, objects), *_openmp()[1], f"-L{TORCH_LIB}", "-lc10", "-ltorch_cpu"]
        if platform.system() == "Darwin":
            link += ["-undefined", "dynamic_lookup"]
        run = subprocess.run([*link, "-o", str(partial)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"the {variant.name} kernels did not link:\n{run.stderr[-4000:]}")
        partial.rename(target)
    return target
