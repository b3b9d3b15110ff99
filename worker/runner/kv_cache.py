"""The paged KV cache's tensors: how many blocks fit the memory budget, and their allocation."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.config import parse_size

log = logging.getLogger(__name__)

CPU_DEFAULT_BYTES = 2**30

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V, [num_blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * dtype.itemsize


def allocate(shape: CacheShape, dtype: torch.dtype, device: torch.device, budget: str, scratch: bool) -> KVCaches:
    """Per layer a K and a V tensor of ``[num_blocks, block_size, kv_heads, head_dim]``, as many
    blocks as ``budget`` (``--kv-cache-memory``) holds, plus one block with ``scratch`` (where CUDA
    graphs' padding rows write)."""
    per_block = shape.bytes_per_block(dtype)
    num_blocks = budget_bytes(budget, device) // per_block
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory {budget} is less than one block ({per_block} bytes)")
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, shape.block_size, num_blocks * per_block / 2**30)
    dims = (num_blocks + scratch, shape.block_size, shape.kv_heads, shape.head_dim)
    return [(torch.zeros(dims, dtype=dtype, device=device), torch.zeros(dims, dtype=dtype, device=device)) for _ in range(shape.layers)]


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
