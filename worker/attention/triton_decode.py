"""Paged decode attention in Triton for the worker's CUDA path, capturable in a CUDA graph.

No flash-attn / FlashInfer wheel fits our torch, so decode rows on CUDA get this kernel (SGLang and
vLLM fall back to Triton decode kernels the same way). It reads the paged KV cache in place through
the block table, one program per (row, KV head, split) handling every query head that shares the KV
head (GQA without expanding the cache), with an online softmax in float32.

Flash-decoding: with few rows the context of each row is split so that enough programs run to fill
the GPU; stage 1 writes each split's normalised output and log-sum-exp into float32 scratch and
stage 2 combines them. The split's token range is worked out inside the kernel from ``lengths``, so
the launch grid depends only on shapes: no ``.item()``, no host sync, nothing data-dependent, and
the call can be captured in ``torch.cuda.graph`` and replayed with new lengths and block tables.

Triton is optional (CI and the CPU path have none): this module imports without it, and
``available()`` says whether the kernel can run. Under ``TRITON_INTERPRET=1`` it runs on CPU
tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import math
import os

import torch

from worker.attention.backend import DecodeBackend
from worker.attention.metadata import DecodeGroup

try:
    import triton
    import triton.language as tl
except ImportError:  # CI and the CPU-only install have no triton
    triton = None
    tl = None

SM_COUNT = 132  # H100 / H200; num_splits aims at two waves of programs over this many SMs
MIN_GROUP_ROWS = 16  # tl.dot needs at least 16 rows: the query heads of a KV head are padded to it
MIN_TILE_TOKENS = 64  # tokens per loop step; a whole number of cache blocks (block sizes 8..64)
MAX_SPLITS = 64


def available() -> bool:
    """Whether ``paged_decode_attention`` can run here: triton importable and a GPU or the interpreter."""
    try:
        return triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")
    except Exception:  # a broken CUDA driver must not take the worker down: fall back to the torch path
        return False


def num_splits(rows: int, kv_heads: int, sm_count: int = SM_COUNT) -> int:
    """Static split count: enough (row, KV head, split) programs to cover the SMs twice when rows are few.

    One split once ``rows * kv_heads`` alone reaches the SM count (splitting then only adds the
    combine pass). A power of two up to MAX_SPLITS, and independent of the table's width, so a
    worker meets a handful of kernel variants, all compiled by ``warm_up`` at its start rather than
    in the middle of a step (a Triton compile takes about half a second). Splits past a short row's
    blocks are empty and exit at once.
    """
    programs = rows * kv_heads
    if programs == 0 or programs >= sm_count:
        return 1
    target = min(MAX_SPLITS, (2 * sm_count) // programs)
    return 1 << (target.bit_length() - 1) if target > 1 else 1


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> None:
    """Compile every variant ``paged_decode_attention`` can launch for these caches (one per split
    count), with one row of length 1 reading block 0."""
    _, _, kv_heads, head_dim = k_cache.shape
    query = torch.zeros(1, heads, head_dim, dtype=k_cache.dtype, device=k_cache.device)
    table = torch.zeros(1, 1, dtype=torch.long, device=k_cache.device)
    length = torch.ones(1, dtype=torch.long, device=k_cache.device)
    splits = 1
    while splits <= MAX_SPLITS:
        paged_decode_attention(query, k_cache, v_cache, table, length, 1.0, splits)
        splits *= 2


if triton is not None:

    @triton.jit(do_not_specialize=["stride_table"])  # the table's width changes from step to step
    def _decode_split_kernel(
        query,  # [rows, heads, head_dim]
        k_cache,  # [num_blocks, block_size, kv_heads, head_dim]
        v_cache,
        block_tables,  # [rows, max_blocks] int64
        lengths,  # [rows] int64
        out,  # [rows, heads, splits, head_dim] float32, or [rows, heads, head_dim] when SPLITS == 1
        lse,  # [rows, heads, splits] float32 (unused when SPLITS == 1)
        scale_log2,  # softmax scaling times log2(e): the kernel works in base 2
        stride_qr,
        stride_qh,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_table,
        stride_or,
        stride_oh,
        stride_os,
        stride_lr,
        stride_lh,
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,  # tokens per loop step, a multiple of BLOCK_SIZE
        SPLITS: tl.constexpr,
        DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32), None otherwise
    ):
        """Attention of one row's query heads sharing one KV head over one split of its context."""
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        # This split's token range, from the row's length: block-aligned, empty when the row is short.
        length = tl.load(lengths + row)
        blocks_per_split = tl.cdiv(tl.cdiv(length, BLOCK_SIZE), SPLITS)
        start = split * blocks_per_split * BLOCK_SIZE
        end = tl.minimum(start + blocks_per_split * BLOCK_SIZE, length)

        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        heads = kv_head * GROUP + group
        head_mask = group < GROUP
        dim_mask = dims < HEAD_DIM
        q_mask = head_mask[:, None] & dim_mask[None, :]
        q = tl.load(query + row * stride_qr + heads[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)

        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scaled scores
        total = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2(score - m)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        offsets = tl.arange(0, TILE)
        for tile_start in range(start, end, TILE):
            tokens = tile_start + offsets
            valid = tokens < end
            # One block-table entry per token: a tile covers TILE // BLOCK_SIZE whole blocks.
            blocks = tl.load(block_tables + row * stride_table + tokens // BLOCK_SIZE, mask=valid, other=0)
            slots = tokens % BLOCK_SIZE
            kv_mask = valid[:, None] & dim_mask[None, :]
            # Masked-off tokens load zeros: a stale or never-written block may hold NaN bit patterns.
            k = tl.load(
                k_cache
                + blocks[:, None] * stride_kb
                + slots[:, None] * stride_kt
                + kv_head * stride_kh
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            scores = tl.where(valid[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache
                + blocks[:, None] * stride_vb
                + slots[:, None] * stride_vt
                + kv_head * stride_vh
                + dims[None, :],
                mask=kv_mask,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m = m_new

        # An empty split leaves m = -inf and total = 0: it writes zeros and lse = -inf, weighed 0 in the combine.
        total = tl.maximum(total, 1e-30)
        acc = acc / total[:, None]
        out_offsets = row * stride_or + heads[:, None] * stride_oh + dims[None, :]
        if SPLITS == 1:
            tl.store(out + out_offsets, acc.to(out.dtype.element_ty), mask=q_mask)
        else:
            tl.store(out + out_offsets + split * stride_os, acc, mask=q_mask)
            tl.store(lse + row * stride_lr + heads * stride_lh + split, m + tl.log2(total), mask=head_mask)

    @triton.jit
    def _combine_kernel(
        partial,  # [rows, heads, splits, head_dim] float32
        lse,  # [rows, heads, splits] float32, base 2
        out,  # [rows, heads, head_dim]
        stride_pr,
        stride_ph,
        stride_ps,
        stride_lr,
        stride_lh,
        stride_or,
        stride_oh,
        SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
    ):
        """Weighs each split's output by its share of the softmax mass (exp2 of its lse)."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        split_mask = splits < SPLITS
        dim_mask = dims < HEAD_DIM
        lses = tl.load(lse + row * stride_lr + head * stride_lh + splits, mask=split_mask, other=float("-inf"))
        top = tl.max(lses, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # a length-0 row (graph padding): every split empty
        weights = tl.exp2(lses - top)  # empty splits: exp2(-inf) = 0
        parts = tl.load(
            partial + row * stride_pr + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
            mask=split_mask[:, None] & dim_mask[None, :],
            other=0.0,
        )
        result = tl.sum(parts * weights[:, None], 0) / tl.maximum(tl.sum(weights, 0), 1e-30)
        tl.store(out + row * stride_or + head * stride_oh + dims, result.to(out.dtype.element_ty), mask=dim_mask)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    splits: int | None = None,
) -> torch.Tensor:
    """One decode token per row attends to its paged context; returns ``[rows, heads, head_dim]``.

    ``query`` is ``[rows, heads, head_dim]``; the caches ``[num_blocks, block_size, kv_heads, head_dim]``
    (same dtype); ``block_tables`` ``[rows, max_blocks]`` int64, padded with any valid block id;
    ``lengths`` ``[rows]`` int64, row r attending positions ``0..lengths[r]-1`` (a length of 0 gives
    zeros). Head h reads KV head ``h // (heads // kv_heads)``. ``splits`` defaults to ``num_splits``.
    Only shapes steer the launch, so this is safe inside CUDA graph capture.
    """
    _check(query, k_cache, v_cache, block_tables)
    rows, heads, head_dim = query.shape
    splits = splits or num_splits(rows, k_cache.shape[2])
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if splits == 1:
        partial, lse = out.unsqueeze(2), out  # stage 1 writes the final output; lse is not touched
    else:
        partial = torch.empty(rows, heads, splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(rows, heads, splits, dtype=torch.float32, device=query.device)
    _split(query, k_cache, v_cache, block_tables, lengths, partial, lse, scaling, splits)
    if splits > 1:
        _combine(partial, lse, out, splits)
    return out


def _split(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    partial: torch.Tensor,
    lse: torch.Tensor,
    scaling: float,
    splits: int,
) -> None:
    """Stage 1: each row's query heads over each split of its context, into ``partial`` and ``lse``.
    Apart from ``paged_decode_attention`` because the launch is mostly the kernel's arguments."""
    rows, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(rows, kv_heads, splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        lengths,
        partial,
        lse,
        scaling * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        GROUP_PAD=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE=max(block_size, MIN_TILE_TOKENS),
        SPLITS=splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else None,  # fp32 stays exact, not TF32
    )


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    """Shapes, dtypes and strides the kernels rely on, refused in one sentence each."""
    _, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if heads % kv_heads or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if block_size & (block_size - 1) or query.dtype != k_cache.dtype or query.dtype != v_cache.dtype:
        raise ValueError(
            f"block size {block_size} must be a power of two and dtypes must match ({query.dtype}, {k_cache.dtype})"
        )
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query, caches and block tables need a contiguous last dimension")


def _combine(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, splits: int) -> None:
    """Stage 2: each row and head's splits, weighted by their log-sum-exps, into ``out``."""
    rows, heads, head_dim = out.shape
    _combine_kernel[(rows, heads)](
        partial,
        lse,
        out,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        SPLITS=splits,
        SPLITS_PAD=triton.next_power_of_2(splits),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


class TritonDecode(DecodeBackend):
    name = "triton"
    in_place_cuda = True

    def prepare(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], heads: int) -> None:
        warm_up(*kv_caches[0], heads=heads)  # compile every variant now, not in the middle of a step

    def __call__(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:
        return paged_decode_attention(query, k_cache, v_cache, group.block_tables, group.lengths, scale)
