"""The worker's C++ CPU kernels, built once into one extension and loaded as ``torch.ops.llmpool``.

One file per op family: ``attention.cpp`` (paged decode attention), ``gemm.cpp`` (int8/q4/bf16
projections, packed VNNI GEMMs), ``decode_step.cpp`` (a whole decode step in one call),
``sampling.cpp``; ``ops.cpp`` registers them, ``vec.h`` holds the 16-float vectors they share.

No maintained paged-attention or small-batch quantized kernel installs with this torch on the CPU
(IPEX and vLLM's CPU build pin other torch versions), so the few kernels the decode path needs are
a small extension compiled with the C++ compiler inductor needs anyway. ``scripts/setup.sh`` builds
it (``python -m worker.kernels``); a worker that cannot load it logs why and runs the torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_FOLDER = Path(__file__).parent
_SOURCES = ("ops.cpp", "attention.cpp", "gemm.cpp", "decode_step.cpp", "sampling.cpp")
_HEADERS = ("vec.h", "gemm.h", "attention.h", "ops.h")
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"]
_loaded: bool | None = None
_error: str | None = None


def _cpu_flags() -> str:
    """The instruction sets ``-march=native`` compiles for (Linux; elsewhere the machine's name)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return os.uname().machine


def _build_dir() -> Path:
    """One folder per sources, flags, torch installation and CPU, holding its own copy of the sources.

    The build's commands name the source and torch's headers: one folder shared by two checkouts or
    two virtual environments was rebuilt (~30 s) by each after the other. Now checkouts that share
    an environment share a build, and each environment keeps its own. A cache that moves to another
    CPU (a worker pod's volume on a new node) never loads code built for other instruction sets
    (``-march=native``: SIGILL)."""
    root = os.environ.get("LLMPOOL_KERNEL_DIR") or Path.home() / ".cache" / "llmpool" / "kernels"
    files = {name: (_FOLDER / name).read_bytes() for name in (*_SOURCES, *_HEADERS)}
    parts = [
        *files.values(),
        " ".join(_CFLAGS).encode(),
        _cpu_flags().encode(),
        str(Path(torch.__file__).parent).encode(),
    ]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]
    path = Path(root) / f"torch-{torch.__version__}-{key}"
    path.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        copy = path / name
        if not copy.is_file() or copy.read_bytes() != content:
            shutil.copyfile(_FOLDER / name, copy)
    return path


def load(verbose: bool = False) -> bool:
    """Build (first time, ~40 s) or load the extension; True when ``torch.ops.llmpool`` is usable."""
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    try:
        from torch.utils.cpp_extension import load as load_extension

        build = _build_dir()
        load_extension(
            name="llmpool_cpu_ops",
            sources=[str(build / name) for name in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            is_python_module=False,
            verbose=verbose,
        )
        _loaded = True
    except Exception as exc:  # no compiler, no headers: the torch path still works
        _loaded, _error = False, f"{type(exc).__name__}: {exc}"
        log.warning("C++ kernels unavailable, using the torch path: %s", _error)
    return _loaded


def unavailable_reason() -> str | None:
    return _error


def has_vnni() -> bool:
    """Whether the loaded kernels have the int8 VNNI paths (AVX512-VNNI at build time)."""
    return load() and bool(torch.ops.llmpool.has_vnni())
