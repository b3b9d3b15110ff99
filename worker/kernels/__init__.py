"""The worker's C++ CPU kernels (cpu_ops.cpp), built once and loaded as ``torch.ops.llmpool``.

No maintained paged-attention or small-batch quantized kernel installs with this torch on the CPU
(IPEX and vLLM's CPU build pin other torch versions), so the few kernels the decode path needs are
a small extension compiled with the C++ compiler inductor needs anyway. ``scripts/setup.sh`` builds
it (``python -m worker.kernels``); a worker that cannot load it logs why and runs the torch path.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_loaded: bool | None = None
_error: str | None = None


def _build_dir() -> Path:
    root = os.environ.get("LLMPOOL_KERNEL_DIR") or Path.home() / ".cache" / "llmpool" / "kernels"
    path = Path(root) / f"torch-{torch.__version__}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load(verbose: bool = False) -> bool:
    """Build (first time, ~40 s) or load the extension; True when ``torch.ops.llmpool`` is usable."""
    global _loaded, _error
    if _loaded is not None:
        return _loaded
    try:
        from torch.utils.cpp_extension import load as load_extension

        load_extension(
            name="llmpool_cpu_ops",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_dir()),
            is_python_module=False,
            verbose=verbose,
        )
        _loaded = True
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: the torch path still works
        _loaded, _error = False, f"{type(exc).__name__}: {exc}"
        log.warning("C++ kernels unavailable, using the torch path: %s", _error)
    return _loaded


def unavailable_reason() -> str | None:
    return _error


def has_vnni() -> bool:
    """Whether the loaded kernels have the int8 VNNI paths (AVX512-VNNI at build time)."""
    return load() and bool(torch.ops.llmpool.has_vnni())
