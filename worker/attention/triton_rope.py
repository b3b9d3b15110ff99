"""Rotary embedding and the KV-cache write of a decode step in one Triton kernel (CUDA path).

Why: on a GPU a decode step replayed from a CUDA graph is bound by kernel launches, not by bytes
(README "On a GPU": about 40 launches a layer, a few microseconds each, against 0.04 ms of weight
reads a layer for a 1B model). In torch, rotary on the queries and keys takes five elementwise
launches, and writing the new keys and values into the paged cache two more plus a copy of the
queries for the attention kernel. Here one launch reads each token's fused QKV projection once and
writes the rotated queries (contiguous ``[tokens, heads, head_dim]``, as the attention kernel takes
them) and the rotated keys and the values into their cache slots.

It computes in float32 and rounds once, where torch's bf16 ops round after each product and the
sum: a rounding apart, well inside the closeness test; float32 workers never take this path.
"""

from __future__ import annotations

import torch

from worker.attention.triton_decode import tl, triton

if triton is not None:

    @triton.jit
    def _rope_and_cache_kernel(
        qkv,  # [tokens, (heads + 2 * kv_heads) * head_dim]
        cos,  # [tokens, head_dim]: cos of the angles, both halves (transformers' layout)
        sin,
        slots,  # [tokens] int64: flat cache slot of each token
        q_out,  # [tokens, heads, head_dim]
        k_cache,  # [num_blocks * block_size, kv_heads, head_dim] (a flat view)
        v_cache,
        stride_qkv,
        stride_cos,
        stride_q,
        stride_slot,  # elements per cache slot: kv_heads * head_dim
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        HALF: tl.constexpr,
    ):
        """One (token, head) of the fused projection: query and key heads rotate, value heads copy."""
        token = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, HEAD_DIM_PAD)
        mask = dims < HEAD_DIM
        row = qkv + token * stride_qkv + head * HEAD_DIM
        x = tl.load(row + dims, mask=mask, other=0.0).to(tl.float32)
        slot = tl.load(slots + token)
        if head < HEADS + KV_HEADS:
            first = dims < HALF
            # rotate_half(x) = cat(-x[HALF:], x[:HALF])
            partner = tl.load(row + tl.where(first, dims + HALF, dims - HALF), mask=mask, other=0.0).to(tl.float32)
            c = tl.load(cos + token * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(sin + token * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
            y = x * c + tl.where(first, -partner, partner) * s
            if head < HEADS:
                tl.store(q_out + token * stride_q + head * HEAD_DIM + dims, y.to(q_out.dtype.element_ty), mask=mask)
            else:
                kv = head - HEADS
                tl.store(k_cache + slot * stride_slot + kv * HEAD_DIM + dims, y.to(k_cache.dtype.element_ty), mask=mask)
        else:
            kv = head - HEADS - KV_HEADS
            tl.store(v_cache + slot * stride_slot + kv * HEAD_DIM + dims, x.to(v_cache.dtype.element_ty), mask=mask)


def rope_and_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """Rotate the queries and keys of ``qkv`` ``[tokens, (heads + 2 kv_heads) * head_dim]`` by
    ``cos`` / ``sin`` ``[tokens, head_dim]``; write keys and values to cache slot ``slots[t]`` of
    ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, kv_heads, head_dim]``; return the queries
    ``[tokens, heads, head_dim]``. Launch shape from tensor shapes only: safe in a CUDA graph."""
    tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    if (
        qkv.stride(-1) != 1
        or cos.stride(-1) != 1
        or sin.stride(-1) != 1
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
    ):
        raise ValueError("rope_and_cache needs contiguous rows of qkv, cos and sin, and contiguous caches")
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_and_cache_kernel[(tokens, heads + 2 * kv_heads)](
        qkv,
        cos,
        sin,
        slots,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        kv_heads * head_dim,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        HALF=head_dim // 2,
    )
    return q
