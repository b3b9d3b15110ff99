"""Paged attention for both model paths (worker/llama.py and transformers' own classes).

The model runner feeds the whole batch as one flat sequence ``[1, num_tokens]`` (decode tokens
first, then prompt chunks) with per-token positions; transformers' classes reach ``paged_attention``
as a registered attention implementation. Each layer writes its new keys/values into the paged cache
(``slot_mapping``) and then:
- decode rows (one query token each) go to the C++ kernel ``torch.ops.llmpool.paged_decode_attention``
  (worker/kernels): it reads the context in place through the block tables, once per KV head for
  all the query heads sharing it, with an online softmax and the context split across threads when
  rows are few. Per layer, CPU time on one thread (bf16, 9 heads / 3 KV heads): 64 rows x 300 tokens
  2.6 ms (inductor-compiled gather+matmul 5.4, eager 19.9); 1 row x 4,096 tokens 0.20 ms (0.96, 1.88).
  On CUDA FlashInfer's paged decode (worker/flashinfer_attention.py) or, where it is not installed,
  the Triton kernel (worker/triton_attention.py) does the same in place; both can be captured in a
  CUDA graph. Without any of them, an eager batched matmul over the gathered context does it.
  A lone float32 row keeps transformers' SDPA call, so float32 greedy output equals ``generate``.
- prompt chunks use SDPA: a first chunk exactly as ``generate`` does, a later one over the cached
  prefix gathered from the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker import triton_attention

if TYPE_CHECKING:
    from worker.flashinfer_attention import FlashInferDecode

ATTENTION_NAME = "llmpool_paged"
# The decode backends that read the cache in place on a GPU; steps of decode rows only then run the
# rotary and cache writes as one Triton kernel too (worker/llama.py), and can be CUDA graphs.
CUDA_KERNELS = ("flashinfer", "triton")


@dataclass(slots=True)
class PrefillSpan:
    """A prompt chunk of one sequence inside the flat batch."""

    start: int
    num_tokens: int
    num_computed: int  # tokens of this sequence already in the cache before this step
    block_table: torch.Tensor  # [num_blocks_of_sequence]
    mask: torch.Tensor | None  # [1, 1, num_tokens, context] causal mask with an offset; None if no prefix


@dataclass(slots=True)
class DecodeGroup:
    """Single-token rows of similar context length, padded to the group's longest one."""

    start: int  # first row of the group within the decode rows
    num_rows: int
    block_tables: torch.Tensor  # [num_rows, max_blocks]
    lengths: torch.Tensor  # [num_rows]: context length of each row, this step's token included
    max_len: int
    planned: FlashInferDecode | None = None  # the "flashinfer" backend's schedule of these rows, made once per step


@dataclass(slots=True)
class AttentionMetadata:
    """Everything a layer needs to find its part of the paged cache for this step."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens]: flat cache slot of each new token
    num_decode: int  # the first num_decode tokens are single-token steps of num_decode sequences
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # Who computes the decode rows' attention (ModelRunner picks it once per worker): "cpu" (the C++
    # kernel), "flashinfer" or "triton" (CUDA kernels) or "eager" (gather + matmul, anywhere).
    decode_backend: str = "eager"


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """``[batch, kv_heads, length, head_dim]`` view of the cached context of each block table."""
    batch = block_tables.shape[0]
    blocks = cache[block_tables]  # [batch, max_blocks, block_size, kv_heads, head_dim]
    return blocks.view(batch, -1, *cache.shape[2:])[:, :length].transpose(1, 2)


def decode_rows_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: DecodeGroup,
    scaling: float,
    backend: str = "eager",
) -> torch.Tensor:
    """Attention for one query token per row over each row's paged context: the C++ kernel (CPU),
    FlashInfer or the Triton kernel (CUDA), or an eager batched matmul over the gathered context
    (``backend``).

    ``query`` is ``[rows, heads, head_dim]``; the caches are ``[num_blocks, block_size, kv_heads,
    head_dim]``; row r attends to its first ``group.lengths[r]`` positions. Heads sharing a KV head
    sit next to each other (head h reads KV head h // groups).
    """
    block_tables, lengths, max_len = group.block_tables, group.lengths, group.max_len
    if backend == "cpu":
        return torch.ops.llmpool.paged_decode_attention(query, k_cache, v_cache, block_tables, lengths, max_len, scaling)
    if backend == "flashinfer":
        return group.planned(query, k_cache, v_cache, scaling)
    if backend == "triton":
        return triton_attention.paged_decode_attention(query, k_cache, v_cache, block_tables, lengths, scaling)
    rows, heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    keys = _gather(k_cache, block_tables, max_len)  # [rows, kv_heads, max_len, head_dim]
    values = _gather(v_cache, block_tables, max_len)
    packed = query.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    scores = torch.matmul(packed, keys.transpose(-1, -2)).float() * scaling
    positions = torch.arange(max_len, device=query.device)
    scores = scores.masked_fill(~(positions < lengths.unsqueeze(1))[:, None, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)
    return out.to(query.dtype).reshape(rows, heads, head_dim)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged_metadata: AttentionMetadata | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache; ``query`` is ``[1, heads, num_tokens, head_dim]``."""
    meta = paged_metadata
    assert meta is not None, "paged_attention needs paged_metadata"  # programming error, not user input
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    kv_shape = k_cache.shape[2:]
    k_cache.view(-1, *kv_shape).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.view(-1, *kv_shape).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    heads, head_dim = query.shape[1], query.shape[3]
    outputs = []
    for group in meta.decode_groups:
        rows = slice(group.start, group.start + group.num_rows)
        q = query[0, :, rows].transpose(0, 1)  # [rows, heads, head_dim]
        if group.num_rows == 1 and query.dtype == torch.float32:  # exactly what generate computes for a lone sequence
            k = _gather(k_cache, group.block_tables, group.max_len)
            v = _gather(v_cache, group.block_tables, group.max_len)
            out, _ = sdpa_attention_forward(module, q.unsqueeze(2), k, v, None, scaling=scaling)
            outputs.append(out.reshape(1, heads, head_dim))
        else:
            scale = scaling or head_dim**-0.5
            outputs.append(decode_rows_attention(q.contiguous(), k_cache, v_cache, group, scale, meta.decode_backend))
    for span in meta.prefills:
        end = span.start + span.num_tokens
        q = query[:, :, span.start : end]
        if span.num_computed == 0:  # a whole prompt, or its first chunk: exactly what generate computes
            k, v = key[:, :, span.start : end], value[:, :, span.start : end]
            out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=scaling, is_causal=True)
            outputs.append(out.reshape(span.num_tokens, heads, head_dim))
            continue
        # A later chunk attends to the cached prefix: enable_gqa with the mask is 2x transformers'
        # repeat_kv route here (which copies the whole context out to every query head).
        table = span.block_table.unsqueeze(0)
        k = _gather(k_cache, table, span.num_computed + span.num_tokens)
        v = _gather(v_cache, table, span.num_computed + span.num_tokens)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1).reshape(span.num_tokens, heads, head_dim))
    return torch.cat(outputs).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
