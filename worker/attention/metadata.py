"""The per-step description of the paged cache that every layer reads (no tensors are computed here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from worker.attention.backend import DecodeBackend
    from worker.attention.layers import LayerSpec


@dataclass(slots=True)
class PrefillSpan:
    """A prompt chunk of one sequence inside the flat batch."""

    start: int
    num_tokens: int
    num_computed: int  # tokens of this sequence already in the cache before this step
    block_table: torch.Tensor  # [num_blocks_of_sequence]
    mask: torch.Tensor | None  # [1, 1, num_tokens, context] causal mask with an offset; None if no prefix
    both_ways: tuple[tuple[int, int], ...] = ()  # prompt ranges attending to each other both ways (Gemma 3's images)


@dataclass(slots=True)
class DecodeGroup:
    """Single-token rows of similar context length, padded to the group's longest one."""

    start: int  # first row of the group within the decode rows
    num_rows: int
    block_tables: torch.Tensor  # [num_rows, max_blocks]
    lengths: torch.Tensor  # [num_rows]: context length of each row, this step's token included
    max_len: int
    planned: Any = (
        None  # FlashInfer's schedule of these rows (worker/attention/flashinfer_decode.py), made once per step
    )


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a layer needs to find its part of the paged cache for this step."""

    kv_caches: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer: [num_blocks, block_size, kv_heads, head_dim] (per-layer shapes)
    slot_mapping: torch.Tensor  # [num_tokens]: flat cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token steps of num_decode sequences
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    decode_backend: DecodeBackend  # who computes the decode rows' attention (worker/attention/chooser.py)
    layers: list[LayerSpec] | None = (
        None  # per layer: mask, features, reference function (worker/runner/probe.py); None: all plain
    )
    masks: dict[tuple[int, int], tuple[int, torch.Tensor]] = field(
        default_factory=dict
    )  # made once per step and mask kind
