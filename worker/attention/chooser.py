"""Which decode attention backend a worker runs, chosen once at start, start-up checks included.

On a CPU: the C++ kernel when the extension loads, else the eager gather. On CUDA: what
``--cuda-attention`` names, or for auto the first that runs of FlashInfer (checked against the
eager gather on this model's head shapes, compiling its kernels), the Triton kernel and the eager
gather. float32 keeps the eager path under auto, so that output equals ``generate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from worker import kernels
from worker.attention import flashinfer_decode, triton_decode
from worker.attention.backend import DecodeBackend
from worker.attention.cpu_decode import CpuDecode
from worker.attention.eager_decode import EagerDecode

log = logging.getLogger(__name__)

ATTENTION_CHOICES = ("auto", "flashinfer", "triton", "eager")


@dataclass(frozen=True, slots=True)
class HeadShape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int


def choose_decode_backend(choice: str, device: torch.device, dtype: torch.dtype, shape: HeadShape) -> DecodeBackend:
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"--cuda-attention must be one of {', '.join(ATTENTION_CHOICES)}; got {choice!r}")
    if device.type == "cpu":
        if choice != "auto":
            log.warning(
                "--cuda-attention %s does not apply on the CPU: not applied (decode attention is the C++ kernel, or the eager gather)",
                choice,
            )
        backend: DecodeBackend = CpuDecode() if kernels.load() else EagerDecode()
    elif choice == "auto":
        backend = _auto(device, dtype, shape)
    elif choice == "flashinfer":
        if not _flashinfer_usable(dtype):
            raise ValueError(
                "--cuda-attention flashinfer needs the flashinfer-python package, triton, a CUDA device and --dtype float16 or bfloat16"
            )
        problem = _check_flashinfer(device, dtype, shape)
        if problem is not None:
            raise ValueError(f"--cuda-attention flashinfer: FlashInfer failed its check: {problem}")
        backend = flashinfer_decode.FlashInferBackend(device)
    elif choice == "triton":
        if not triton_decode.available():
            raise ValueError("--cuda-attention triton needs the triton package and a CUDA device")
        backend = triton_decode.TritonDecode()
    else:
        backend = EagerDecode()
    log.info("decode attention on %s: %s", device, backend.name)
    return backend


def _auto(device: torch.device, dtype: torch.dtype, shape: HeadShape) -> DecodeBackend:
    if dtype == torch.float32:
        return EagerDecode()
    if _flashinfer_usable(dtype):
        problem = _check_flashinfer(device, dtype, shape)
        if problem is None:
            return flashinfer_decode.FlashInferBackend(device)
        log.warning(
            "FlashInfer is installed but failed its check (%s): decode attention falls back to the Triton kernel",
            problem,
        )
    return triton_decode.TritonDecode() if triton_decode.available() else EagerDecode()


def _flashinfer_usable(dtype: torch.dtype) -> bool:
    """Installed, on a GPU, in one of its dtypes, and with triton beside it (decode steps run rotary
    and the cache writes in a Triton kernel, worker/attention/triton_rope.py)."""
    return flashinfer_decode.available() and triton_decode.available() and dtype in flashinfer_decode.DTYPES


def _check_flashinfer(device: torch.device, dtype: torch.dtype, shape: HeadShape) -> str | None:
    """FlashInfer against the eager gather on this model's head shapes (compiling its kernels)."""
    return flashinfer_decode.check(shape.heads, (shape.block_size, shape.kv_heads, shape.head_dim), dtype, device)
