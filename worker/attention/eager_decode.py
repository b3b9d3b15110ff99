"""Decode attention as plain torch: gather each row's context out of the cache, then batched matmuls.

Runs anywhere; the fallback where no kernel applies (CUDA without Triton, float32 on CUDA, a CPU
without the C++ kernels) and the reference the kernels are checked against.
"""

from __future__ import annotations

import torch

from worker.attention.backend import DecodeBackend
from worker.attention.metadata import DecodeGroup


def gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """``[batch, kv_heads, length, head_dim]`` view of the cached context of each block table."""
    batch = block_tables.shape[0]
    blocks = cache[block_tables]  # [batch, max_blocks, block_size, kv_heads, head_dim]
    return blocks.view(batch, -1, *cache.shape[2:])[:, :length].transpose(1, 2)


class EagerDecode(DecodeBackend):
    """Pads every row to its group's longest context, so the runner groups rows of similar length."""

    name = "eager"
    reads_row_lengths = False

    def __call__(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:
        rows, heads, head_dim = query.shape
        kv_heads = k_cache.shape[2]
        keys = gather(k_cache, group.block_tables, group.max_len)  # [rows, kv_heads, max_len, head_dim]
        values = gather(v_cache, group.block_tables, group.max_len)
        packed = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
        scores = torch.matmul(packed, keys.transpose(-1, -2)).float() * scale
        positions = torch.arange(group.max_len, device=query.device)
        scores = scores.masked_fill(~(positions < group.lengths.unsqueeze(1))[:, None, None, :], float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)
        return out.to(query.dtype).reshape(rows, heads, head_dim)
