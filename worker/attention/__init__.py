"""Paged attention for both model paths: the per-step metadata, the layer function transformers'
classes and the native forward call, and one decode backend per module behind a single chooser.

    metadata.py           AttentionMetadata, DecodeGroup, PrefillSpan: where a step's tokens sit in the cache
    paged.py              paged_attention: cache writes, decode rows to the backend, prompt chunks through SDPA
    backend.py            DecodeBackend: what every decode backend provides
    eager_decode.py       gather + matmul, anywhere (the reference)
    cpu_decode.py         the C++ kernel (worker/kernels)
    triton_decode.py      the Triton kernel (CUDA, capturable in graphs)
    flashinfer_decode.py  FlashInfer's paged decode (CUDA, where installed)
    triton_rope.py        rotary + cache writes of CUDA decode steps in one Triton kernel
    chooser.py            choose_decode_backend: which one a worker uses, and its start-up checks
"""

from worker.attention.backend import DecodeBackend
from worker.attention.chooser import ATTENTION_CHOICES, HeadShape, choose_decode_backend
from worker.attention.eager_decode import EagerDecode
from worker.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan
from worker.attention.paged import ATTENTION_NAME, paged_attention

__all__ = [
    "ATTENTION_CHOICES",
    "ATTENTION_NAME",
    "AttentionMetadata",
    "DecodeBackend",
    "DecodeGroup",
    "EagerDecode",
    "HeadShape",
    "PrefillSpan",
    "choose_decode_backend",
    "paged_attention",
]
