"""The paged KV cache's tensors: how many blocks fit the memory budget, and their allocation."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.config import parse_size

log = logging.getLogger(__name__)

CPU_DEFAULT_BYTES = 2**30

KVCaches = list[
    tuple[torch.Tensor, torch.Tensor]
]  # per layer: K and V, [num_blocks, block_size, kv_heads, head_dim]; shapes may differ by layer


@dataclass(frozen=True, slots=True)
class CacheShape:
    """Per layer (kv_heads, key width, value width), as the start-up probe found them: layers may
    differ (a model's global and local layers), and keys may be wider than values (latent attention)."""

    layers: tuple[tuple[int, int, int], ...]
    block_size: int

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return sum(self.block_size * heads * (k_dim + v_dim) for heads, k_dim, v_dim in self.layers) * dtype.itemsize


def allocate(
    shape: CacheShape,
    dtype: torch.dtype,
    device: torch.device,
    budget: str,
    scratch: bool,
    agree: Callable[[int], int] | None = None,
) -> KVCaches:
    """Per layer a K and a V tensor of ``[num_blocks, block_size, kv_heads, dim]``, as many
    blocks as ``budget`` (``--kv-cache-memory``) holds, plus one block with ``scratch`` (where CUDA
    graphs' padding rows write). ``agree``: the count all ranks of a split model use, given ours."""
    per_block = shape.bytes_per_block(dtype)
    num_blocks = budget_bytes(budget, device) // per_block
    if agree is not None:
        num_blocks = agree(num_blocks)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory {budget} is less than one block ({per_block} bytes)")
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, shape.block_size, num_blocks * per_block / 2**30
    )
    blocks = (num_blocks + scratch, shape.block_size)
    return [
        (
            torch.zeros(*blocks, heads, k_dim, dtype=dtype, device=device),
            torch.zeros(*blocks, heads, v_dim, dtype=dtype, device=device),
        )
        for heads, k_dim, v_dim in shape.layers
    ]


def budget_bytes(budget: str, device: torch.device) -> int:
    """``--kv-cache-memory`` in bytes: a size, a fraction of free GPU memory, or auto."""
    on_gpu = device.type == "cuda"
    if budget == "auto":
        budget = "0.85" if on_gpu else str(CPU_DEFAULT_BYTES)
    if "." in budget and float(budget) <= 1.0:
        if not on_gpu:
            raise ValueError("a fractional --kv-cache-memory needs a GPU; give bytes on the CPU (e.g. 2GiB)")
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * float(budget))
    return parse_size(budget)
