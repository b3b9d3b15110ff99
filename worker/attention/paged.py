"""Paged attention as transformers' models call it: the one function both model paths run per layer.

The model runner feeds the whole batch as one flat sequence ``[1, num_tokens]`` (decode tokens
first, then prompt chunks) with per-token positions; transformers' classes reach ``paged_attention``
as a registered attention implementation, and the native forward (worker/models/llama.py) calls it
directly. Each layer writes its new keys/values into the paged cache (``slot_mapping``) and then:
- decode rows (one query token each) go to the step's decode backend (worker/attention/chooser.py
  picks it: the C++ kernel on a CPU, FlashInfer or Triton on CUDA, the eager gather elsewhere). A
  lone float32 row keeps transformers' SDPA call, so float32 greedy output equals ``generate``.
- prompt chunks use SDPA: a first chunk exactly as ``generate`` does, a later one over the cached
  prefix gathered from the cache.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.attention.eager_decode import gather
from worker.attention.metadata import AttentionMetadata

ATTENTION_NAME = "llmpool_paged"


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
            k = gather(k_cache, group.block_tables, group.max_len)
            v = gather(v_cache, group.block_tables, group.max_len)
            out, _ = sdpa_attention_forward(module, q.unsqueeze(2), k, v, None, scaling=scaling)
            outputs.append(out.reshape(1, heads, head_dim))
        else:
            scale = scaling or head_dim**-0.5
            outputs.append(meta.decode_backend(q.contiguous(), k_cache, v_cache, group, scale))
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
        k = gather(k_cache, table, span.num_computed + span.num_tokens)
        v = gather(v_cache, table, span.num_computed + span.num_tokens)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1).reshape(span.num_tokens, heads, head_dim))
    return torch.cat(outputs).unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
