"""The runner's choices, made once at start from the flags and the machine: device, dtype, the decode
step's weights (quantization), the model implementation and CUDA graphs. Each refuses a flag it
cannot honour with an error that says why, rather than ignoring it."""

from __future__ import annotations

import ctypes
import gc
import logging
from pathlib import Path

import torch

from worker import cpu, kernels
from worker.attention import DecodeBackend
from worker.models import fused_decode
from worker.models.fused_decode import FusedDecode
from worker.models.llama import LlamaForward, supports
from worker.models.shapes import Family
from worker.quantization import CHOICES as QUANTIZATION_CHOICES
from worker.quantization import on_4bit_grid

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device | None = None, quantized_at_rest: bool = False) -> torch.dtype:
    """``auto``: bfloat16 on a GPU, and on a CPU that computes it natively (AVX512-BF16 or AMX, where it
    decodes about 2x faster than fp32); elsewhere float32 (torch emulates bf16 there, and oneDNN
    refuses to pack its weights), with the C++ step's int8/q4 weights (``pick_decode_path``). A model
    quantized at rest (a GGUF) on the CPU: float32, its weights de-quantized exactly, for the C++ step
    that then runs every batch (``rows_only``) on every CPU alike. An explicit bfloat16 or float16
    the CPU cannot compute is refused in one sentence."""
    on_cpu = device is None or device.type == "cpu"
    if name == "auto":
        if on_cpu and quantized_at_rest:
            return torch.float32
        return torch.bfloat16 if not on_cpu or cpu.native_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    if on_cpu and name != "float32" and not cpu.native_bf16():
        raise ValueError(
            f"--dtype {name} needs a CPU that computes it natively (AVX512-BF16 or AMX; this one runs the "
            f"{cpu.chosen().name} kernels): leave --dtype at auto for float32 with int8/q4 weights, or give float32"
        )
    return _DTYPES[name]


def pick_decode_path(
    choice: str, device: torch.device, dtype: torch.dtype, model: torch.nn.Module, dtype_flag: str = "auto"
) -> tuple[str, bool]:
    """(weights, whether the C++ decode step runs): it runs on the CPU in bf16/fp16, or in any dtype
    once weights are quantized, for the families it knows (worker/models/family.py). An explicit
    ``--dtype float32`` without quantization keeps the exact torch path (token-identical to
    ``generate``); float32 chosen by ``--dtype auto`` (a CPU without native bf16) takes int8/q4
    weights, as bf16 does. Weights that would not be used are refused when asked for, never
    reported as applied."""
    if choice not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {choice!r}")
    why_not = (
        "not on the CPU"
        if device.type != "cpu"
        else None
        if kernels.load()
        else f"no C++ kernels ({kernels.unavailable_reason()})"
    )
    why_not = why_not or fused_decode.supports(model)
    if choice == "auto":
        exact = dtype == torch.float32 and dtype_flag != "auto"
        choice = "none" if why_not or exact else "int8"
        if choice == "int8" and on_4bit_grid(model):
            choice = "q4"  # the model came as 4-bit weights: q4 keeps them as they are, at 0.6x int8's bytes
    if choice != "none" and why_not:
        raise ValueError(
            f"--quantization {choice} sets the weights of the C++ decode step, which cannot run here: {why_not}"
        )
    fast = why_not is None and (choice != "none" or dtype != torch.float32)
    where = f"{cpu.describe()}; " if device.type == "cpu" else ""  # the one start-up line that names the path
    activations = str(dtype).removeprefix("torch.")
    if fast:
        log.info("%s%s activations; decode steps: the C++ step, weights %s", where, activations, choice)
    else:
        log.info(
            "%sdecode steps: the torch path in %s (the C++ step: %s)",
            where,
            activations,
            why_not or "float32 stays exact",
        )
    return choice, fast


def pick_impl(choice: str, model: torch.nn.Module) -> LlamaForward | None:
    """The native torch forward (worker/models/llama.py) where it supports the model and ``choice``
    allows it; None: transformers' own classes. Build the fused decode step first: this one takes
    the model's layers."""
    if choice not in ("auto", "native", "transformers"):
        raise ValueError(f"--model-impl must be auto, native or transformers; got {choice!r}")
    native_ok = supports(model)
    if choice == "native" and not native_ok:
        raise ValueError(f"--model-impl native does not support model type {model.config.model_type!r}")
    use_native = native_ok and choice != "transformers"
    log.info("model implementation: %s", "native (worker/models/llama.py)" if use_native else "transformers classes")
    if not use_native:
        return None
    return LlamaForward(model)


def build_fused(
    fast: bool, model: torch.nn.Module, quantization: str, cache: Path | None, family: Family | None = None
) -> FusedDecode | None:
    """The C++ decode step's copy of the model when decode steps run there (``pick_decode_path``)."""
    return FusedDecode(model, quantization, cache, family) if fast else None


def rows_only(wanted: bool | None, fused: FusedDecode | None, by_default: bool = False) -> bool:
    """``--quantized-only``: every batch, prompts included, runs the C++ step, whose weights must then
    be packed for its GEMM kernels (int8 or q4), else it is refused. Unset (None), it is on where
    ``by_default`` (a GGUF on the CPU in float32) and the step takes every batch: the answers are then
    the C++ step's alone, the same bits on avx2 as on avx512 (worker/kernels/packed.cpp), where a
    torch prompt path's would follow the CPU's own matmuls."""
    if wanted is None:
        wanted = by_default and fused is not None and fused.any_batch
        if wanted:
            log.info(
                "prompts run through the C++ step too (a GGUF on the CPU; --no-quantized-only keeps them on torch)"
            )
    if not wanted:
        return False
    if fused is None or not fused.any_batch:
        why = (
            "the C++ step does not run this model here"
            if fused is None
            else "its weights are not packed for every matrix"
        )
        raise ValueError(
            f"--quantized-only runs every batch through the C++ step's quantized weights, which cannot take prompts here: {why} "
            "(it needs --quantization int8 or q4, and matrix sizes that are multiples of 16)"
        )
    return True


def free_float_weights(model: torch.nn.Module, fused: FusedDecode) -> int:
    """Drop the float copy of the decoder layers' weights (and of an untied head): with
    ``--quantized-only`` the C++ step holds its own quantized copy, and the embedding table is all
    it reads of the model. What is kept is copied out of the files it may have been mapped from
    (the conversion caches), so those mappings, and their pages in the resident set, go too.
    Returns the bytes freed."""
    freed = 0
    params = list(model.model.layers.parameters())
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        params.append(head.weight)
    for param in params:
        freed += param.numel() * param.element_size()
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
    keep_off_files(model)
    fused.own_copies()
    gc.collect()
    try:  # hand the freed pages back to the system now (glibc keeps them for reuse otherwise)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    log.info("--quantized-only: freed %.0f MB of float weights", freed / 2**20)
    return freed


def keep_off_files(model: torch.nn.Module) -> None:
    """Copy the model's weights into memory of their own. Loaded weights are views of the mapped
    conversion-cache file, and the whole mapping stays resident while one of them lives: once the
    native forward has taken the layers (its own packed copies), the embedding and the norms kept
    the 1B model's 2 GB file in the resident set."""
    for kept in (*model.parameters(), *model.buffers()):
        kept.data = kept.data.clone()


def use_graphs(choice: str, device: torch.device, native: LlamaForward | None, backend: DecodeBackend) -> bool:
    """CUDA graphs need the native forward and an attention kernel whose launches a graph can hold
    (Triton's launch shape is static; FlashInfer's is, with a schedule per batch-size bucket)."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--cuda-graphs must be auto, on or off; got {choice!r}")
    possible = device.type == "cuda" and native is not None and backend.in_place_cuda
    if choice == "on" and not possible:
        raise ValueError(
            "--cuda-graphs on needs a CUDA device, a Llama-family model (--model-impl native) and --cuda-attention flashinfer or triton"
        )
    return possible and choice != "off"
