"""The worker's C++ CPU kernels: one library per instruction-set variant (worker/cpu.py), its ops
registered as ``torch.ops.llmpool_<variant>``; ``ops()`` is the variant this CPU runs (at or under
``LLMPOOL_CPU_ISA``).

One file per op family: ``attention.cpp`` (paged decode attention), ``gemm.cpp`` (row-major
int8/q4/bf16/fp16/fp32 projections), ``packed.cpp`` (the packed int8 and q4 GEMMs), ``decode_step.cpp``
(a whole decode step in one call), ``sampling.cpp``; ``ops.cpp`` registers them. ``vec.h`` gives
them 16-float vectors and int8 dot products from the variant's ``isa_avx512.h``, ``isa_avx2.h``,
``isa_neon.h`` (neon, and neon_i8mm with its smmla row pairs) or ``isa_portable.h``, picked by the
target flags the variant is compiled with (no ``-march=native``: a build, an image or a cache moved
to another CPU of the architecture still runs). ``compile.py`` builds a variant.

No maintained paged-attention or small-batch quantized kernel installs with this torch on the CPU
(IPEX and vLLM's CPU build pin other torch versions), so the few kernels the decode path needs are
a small extension compiled with the C++ compiler inductor needs anyway. ``scripts/setup.sh`` builds
every variant of the architecture (``python -m worker.kernels --all``); a worker that cannot build
its variant logs why and loads the next one under it (portable last), and the torch path only where
none builds.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from worker import cpu
from worker.kernels.compile import compile_variant, namespace

log = logging.getLogger(__name__)

_loaded: dict[str, bool] = {}
_errors: dict[str, str] = {}
_fell_back: set[str] = set()
_active: dict[str | None, cpu.Variant | None] = {}  # per LLMPOOL_CPU_ISA value


def load_variant(variant: cpu.Variant) -> bool:
    """Build (first time) and load one variant's library; True when its ops are usable. A variant the
    CPU cannot execute is never loaded (its first instruction would be SIGILL)."""
    if variant.name in _loaded:
        return _loaded[variant.name]
    try:
        if variant not in cpu.runnable():
            missing = " ".join(sorted(variant.needs - cpu.features()))
            raise RuntimeError(f"this CPU cannot run the {variant.name} kernels (it lacks {missing})")
        torch.ops.load_library(str(compile_variant(variant)))
        _loaded[variant.name] = True
    except Exception as exc:  # no compiler, no headers: the torch path still works
        _loaded[variant.name], _errors[variant.name] = False, f"{type(exc).__name__}: {exc}"
        log.warning("C++ kernels (%s) unavailable: %s", variant.name, _errors[variant.name])
    return _loaded[variant.name]


def active() -> cpu.Variant | None:
    """The variant ``load()`` settled on: the chosen one, or the best under it that built (None: none
    did). Settled once per cap: ``ops()`` asks on every decode attention call."""
    limit = os.environ.get(cpu.CAP_VARIABLE)
    if limit not in _active:
        _active[limit] = next((v for v in cpu.candidates() if load_variant(v)), None)
    return _active[limit]


def load() -> bool:
    """Load (building if needed) the variant this CPU runs, or the next one under it where that one
    does not build; True when ``ops()`` is usable."""
    variant = active()
    if variant is not None and variant != cpu.chosen() and variant.name not in _fell_back:
        _fell_back.add(variant.name)
        log.warning("C++ kernels: running the %s variant instead of %s", variant.name, cpu.chosen().name)
    return variant is not None


def ops() -> Any:
    """The loaded variant's ops (``torch.ops.llmpool_<variant>``); call ``load()`` first."""
    variant = active()
    return getattr(torch.ops, namespace(variant or cpu.chosen()))


def variant_ops(variant: cpu.Variant) -> Any:
    """One variant's ops, for tests that compare variants in one process."""
    if not load_variant(variant):
        raise RuntimeError(_errors[variant.name])
    return getattr(torch.ops, namespace(variant))


def unavailable_reason() -> str | None:
    """Why the chosen variant is not the one running (its build's error), or None."""
    return _errors.get(cpu.chosen().name)
