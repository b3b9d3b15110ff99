"""Paged attention as transformers' models call it: the one function both model paths run per layer.

The model runner feeds the whole batch as one flat sequence ``[1, num_tokens]`` (decode tokens
first, then prompt chunks) with per-token positions; transformers' classes reach ``paged_attention``
as a registered attention implementation, and the native forward calls it directly. Each layer
writes its new keys/values into the paged cache (``slot_mapping``) and then, per sequence:
- plain causal layers (worker/attention/layers.py: no window, chunk, softcap or sinks): decode rows
  go to the step's decode backend (worker/attention/chooser.py: the C++ kernel on a CPU, FlashInfer
  or Triton on CUDA, the eager gather elsewhere); prompt chunks use SDPA, a first chunk exactly as
  ``generate`` does, a later one over the cached prefix gathered from the cache.
- every other layer, a chunk holding image tokens that attend to each other both ways (Gemma 3's,
  ``PrefillSpan.both_ways``), a lone float32 decode row, and models whose reference is their eager
  attention: the model's own attention function over the sequence's gathered context, with the
  mask the model builds for the layer (sliding window, chunked), so softcaps and sinks are applied
  as ``generate`` applies them.

The step's metadata arrives as the ``paged_metadata`` kwarg, or, for models whose layers do not
pass kwargs on to attention (StableLM, Nemotron), from ``step_metadata`` around the model call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker.attention.eager_decode import gather
from worker.attention.layers import LayerSpec, gather_context, reference_attention, rows_mask, span_mask
from worker.attention.metadata import AttentionMetadata, DecodeGroup, PrefillSpan

ATTENTION_NAME = "llmpool_paged"
_DEFAULT_LAYER = LayerSpec(
    -1, 0, 0, 0, 0, reference=sdpa_attention_forward
)  # metadata without probed layers: plain SDPA
_STEP: ContextVar[AttentionMetadata | None] = ContextVar("llmpool_step", default=None)


@contextmanager
def step_metadata(metadata: AttentionMetadata) -> Iterator[None]:
    """The step's metadata for layers that are not handed it as a kwarg."""
    token = _STEP.set(metadata)
    try:
        yield
    finally:
        _STEP.reset(token)


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
    """Attention over the paged cache; ``query`` is ``[1, heads, num_tokens, head_dim]``; the model's
    own mask (built for a flat batch it does not know about) is not used."""
    meta = paged_metadata or _STEP.get()
    if meta is None:
        raise RuntimeError("paged_attention ran outside a worker step (no paged metadata): a programming error")
    index = module.layer_idx
    k_cache, v_cache = meta.kv_caches[index]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    layer = meta.layers[index] if meta.layers else _DEFAULT_LAYER
    plain = layer.plain and kwargs.get("softcap") is None and kwargs.get("s_aux") is None
    kwargs["scaling"] = scaling
    heads, v_dim = query.shape[1], value.shape[3]
    outputs = []
    for group in meta.decode_groups:
        q = query[0, :, group.start : group.start + group.num_rows].transpose(0, 1)  # [rows, heads, head_dim]
        if plain and not (group.num_rows == 1 and query.dtype == torch.float32):
            outputs.append(
                meta.decode_backend(q.contiguous(), k_cache, v_cache, group, scaling or query.shape[3] ** -0.5)
            )
        else:  # a lone float32 row computes exactly what generate computes
            outputs.append(
                _reference_rows(layer, module, q, (k_cache, v_cache), group, meta, kwargs).reshape(
                    group.num_rows, heads, v_dim
                )
            )
    for span in meta.prefills:
        out = _prompt_chunk(
            layer, plain and layer.calls_sdpa, module, query, key, value, (k_cache, v_cache), span, meta, kwargs
        )
        outputs.append(out.reshape(span.num_tokens, heads, v_dim))
    return torch.cat(outputs).unsqueeze(0), None


def _prompt_chunk(
    layer: LayerSpec,
    sdpa: bool,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    span: PrefillSpan,
    meta: AttentionMetadata,
    kwargs: dict,
) -> torch.Tensor:
    """One prompt chunk's attention ``[1, tokens, heads, v_dim]``: ``sdpa`` for a plain layer whose
    model runs SDPA, else the model's attention function under the layer's own mask."""
    end = span.start + span.num_tokens
    q = query[:, :, span.start : end]
    if sdpa and not span.both_ways:
        if span.num_computed == 0:  # a whole prompt, or its first chunk: exactly what generate computes
            out, _ = sdpa_attention_forward(
                module,
                q,
                key[:, :, span.start : end],
                value[:, :, span.start : end],
                None,
                scaling=kwargs["scaling"],
                is_causal=True,
            )
            return out
        # A later chunk attends to the cached prefix: enable_gqa with the mask is 2x transformers'
        # repeat_kv route here (which copies the whole context out to every query head).
        table = span.block_table.unsqueeze(0)
        k = gather(cache[0], table, span.num_computed + span.num_tokens)
        v = gather(cache[1], table, span.num_computed + span.num_tokens)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=span.mask, scale=kwargs["scaling"], enable_gqa=True
        ).transpose(1, 2)
    memo = (id(layer.mask), span.start)
    if memo not in meta.masks:
        meta.masks[memo] = span_mask(layer.mask, span.num_computed, span.num_tokens, query.device)
        if span.both_ways:
            meta.masks[memo] = _open_runs(*meta.masks[memo], span)
    start, mask = meta.masks[memo]
    if span.num_computed == 0 and start == 0:  # all its keys are this step's: no need to read them back
        keys, values = key[:, :, span.start : end], value[:, :, span.start : end]
    else:
        keys, values = gather_context(cache, span.block_table.unsqueeze(0), start, span.num_computed + span.num_tokens)
    return reference_attention(layer, module, q, keys, values, mask.unsqueeze(0), kwargs)


def _open_runs(start: int, mask: torch.Tensor, span: PrefillSpan) -> tuple[int, torch.Tensor]:
    """The layer's mask with each run of ``span.both_ways`` open both ways: a query also sees the later
    keys of its own run (transformers' ``token_type_ids`` overlay; those keys are inside every window)."""
    queries = torch.arange(span.num_computed, span.num_computed + span.num_tokens, device=mask.device).unsqueeze(1)
    keys = torch.arange(start, span.num_computed + span.num_tokens, device=mask.device).unsqueeze(0)
    opened = mask.clone()
    for low, high in span.both_ways:
        inside = (queries >= low) & (queries < high) & (keys > queries) & (keys < high)
        opened |= inside
    return start, opened


def _reference_rows(
    layer: LayerSpec,
    module: torch.nn.Module,
    query: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    group: DecodeGroup,
    meta: AttentionMetadata,
    kwargs: dict,
) -> torch.Tensor:
    """Decode rows ``[rows, heads, d]`` as one batch through the model's attention function, each
    row masked to its own context (and window)."""
    memo = (id(layer.mask), -1 - group.start)
    if memo not in meta.masks:
        meta.masks[memo] = rows_mask(layer.mask, group.lengths, group.max_len)
    start, mask = meta.masks[memo]
    keys, values = gather_context(cache, group.block_tables, start, group.max_len)
    return reference_attention(layer, module, query.unsqueeze(2), keys, values, mask.unsqueeze(1), kwargs)


AttentionInterface.register(ATTENTION_NAME, paged_attention)
