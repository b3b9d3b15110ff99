"""The runner's choices, made once at start from the flags and the machine: device, dtype, the decode
step's weights (quantization), the model implementation and CUDA graphs. Each refuses a flag it
cannot honour with an error that says why, rather than ignoring it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from worker import kernels
from worker.attention import DecodeBackend
from worker.models.llama import LlamaForward, supports
from worker.quantization import CHOICES as QUANTIZATION_CHOICES
from worker.quantization import on_4bit_grid

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str) -> torch.dtype:
    """bfloat16 by default: on this project's CPUs (AVX-512 bf16) it decodes about 2x faster than fp32."""
    if name == "auto":
        return torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"--dtype must be one of auto, {', '.join(_DTYPES)}; got {name!r}")
    return _DTYPES[name]


def wants_native(choice: str, model: torch.nn.Module) -> bool:
    """Whether the native forward (worker/models/) runs ``model``: where it supports the model and
    ``--model-impl`` allows it; else transformers' own classes."""
    if choice not in ("auto", "native", "transformers"):
        raise ValueError(f"--model-impl must be auto, native or transformers; got {choice!r}")
    native_ok = supports(model)
    if choice == "native" and not native_ok:
        raise ValueError(f"--model-impl native does not support model type {model.config.model_type!r}")
    return native_ok and choice != "transformers"


def pick_decode_path(choice: str, device: torch.device, dtype: torch.dtype, model: torch.nn.Module, native: bool) -> tuple[str, bool]:
    """(weights, whether the C++ decode step runs): it runs the native forward on the CPU in
    bf16/fp16, or in any dtype once weights are quantized; float32 without quantization keeps the
    exact torch path (token-identical to ``generate``). Quantized weights exist only for the C++
    step: asked for on transformers' classes, they are refused rather than silently not applied."""
    if choice not in QUANTIZATION_CHOICES:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {choice!r}")
    usable = device.type == "cpu" and kernels.load()
    if not native:
        if choice not in ("auto", "none"):
            raise ValueError(
                f"--quantization {choice} applies to the C++ decode step of the native forward, which does not run model type "
                f"{model.config.model_type!r} (it runs on transformers' classes, weights in {str(dtype).removeprefix('torch.')}): "
                "use --quantization none or auto"
            )
        log.info("decode: transformers classes, weights in %s (no C++ decode step or quantization for this model)", str(dtype).removeprefix("torch."))
        return "none", False
    if choice == "auto":
        choice = "none" if not usable or dtype == torch.float32 else "int8"
        if choice == "int8" and kernels.has_vnni() and on_4bit_grid(model):
            choice = "q4"  # the model came as 4-bit weights: q4 keeps them as they are, at 0.6x int8's bytes
    if choice != "none" and not usable:
        raise ValueError(f"--quantization {choice} needs the C++ CPU kernels: {kernels.unavailable_reason() or 'not on the CPU'}")
    fast = usable and (choice != "none" or dtype != torch.float32)
    log.info("small-batch decode: %s, weights %s", "C++ kernel" if fast else "torch", choice)
    return choice, fast


def pick_impl(native: bool, model: torch.nn.Module, fast_decode: bool, quantization: str, cache: Path | None) -> LlamaForward | None:
    """The native forward (worker/models/llama.py) where ``wants_native`` chose it; None: transformers' own classes."""
    log.info("model implementation: %s", "native (worker/models/llama.py)" if native else "transformers classes")
    if not native:
        return None
    return LlamaForward(model, fast_decode=fast_decode, quantization=quantization, cache=cache)


def use_graphs(choice: str, device: torch.device, native: LlamaForward | None, backend: DecodeBackend) -> bool:
    """CUDA graphs need the native forward and an attention kernel whose launches a graph can hold
    (Triton's launch shape is static; FlashInfer's is, with a schedule per batch-size bucket)."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--cuda-graphs must be auto, on or off; got {choice!r}")
    possible = device.type == "cuda" and native is not None and backend.in_place_cuda
    if choice == "on" and not possible:
        raise ValueError("--cuda-graphs on needs a CUDA device, a Llama-family model (--model-impl native) and --cuda-attention flashinfer or triton")
    return possible and choice != "off"
