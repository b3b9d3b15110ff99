"""What a decode attention backend is: one query token per row over each row's paged context.

Each backend lives in a module of its own (``eager``, ``cpu``, ``triton``, ``flashinfer``) and is
chosen once per worker by ``worker.attention.chooser``, which also runs its start-up checks. The
choice travels as an object in each step's ``AttentionMetadata``; a layer just calls it.
"""

from __future__ import annotations

import torch

from worker.attention.metadata import DecodeGroup


class DecodeBackend:
    """``query`` ``[rows, heads, head_dim]`` attends over the caches ``[num_blocks, block_size,
    kv_heads, head_dim]``: row r to its first ``group.lengths[r]`` positions. Heads sharing a KV head
    sit next to each other (head h reads KV head h // groups)."""

    name = "base"
    in_place_cuda = False  # a CUDA kernel reading the cache in place: fused rotary + cache writes, graphs
    reads_row_lengths = True  # each row's own length: all decode rows of a step in one group

    def prepare(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], heads: int) -> None:
        """Once the caches exist: compile what would otherwise compile in the middle of a step."""

    def plan(self, group: DecodeGroup, tables: list[list[int]], lengths: list[int]) -> None:
        """A step's schedule of ``group``'s rows, made on the host once for all layers."""

    def __call__(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:
        raise NotImplementedError
