"""A model's attention learned by running it once: a 2-token forward through a recording attention
function tells, per layer, its KV shapes (no config field needed: MHA, GQA, multi-query and
latent-attention keys alike), whether it calls attention at all, the kwargs it passes (softcap,
sinks) and the mask the model builds for it (transformers' masking utilities are asked through a
recording mask function too: causal, sliding window, chunked).

What it cannot serve it refuses here, by name (worker/models/support.py): layers that never call
attention (recurrent or convolution state), attention that bypasses the interface, masks the model
builds by hand.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, sdpa_mask

from worker.attention import ATTENTION_NAME
from worker.attention.layers import CAUSAL, LayerSpec, MaskKind
from worker.models.support import UnsupportedModel

PROBE_NAME = "llmpool_probe"


def learn_layers(model: torch.nn.Module) -> list[LayerSpec]:
    """Each attention layer of ``model`` (index order), then the model switched to paged attention."""
    config = model.config
    reference_impl = config._attn_implementation  # what generate runs: sdpa, or eager where the model needs it
    masks: dict[int, MaskKind] = {}
    made: list[torch.Tensor] = []  # kept alive, so that no two masks share an address
    found: dict[int, LayerSpec] = {}
    unknown_masks: list[int] = []
    names = {id(module): name for name, module in model.named_modules()}

    def record_mask(
        batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0, **kwargs: object
    ) -> torch.Tensor:
        function = kwargs.get("mask_function", causal_mask_function)
        args = {k: kwargs[k] for k in ("attention_mask", "use_vmap", "device") if k in kwargs}
        mask = sdpa_mask(
            batch_size,
            q_length,
            kv_length,
            q_offset,
            kv_offset,
            mask_function=function,
            allow_is_causal_skip=False,
            **args,
        )
        made.append(mask)
        masks[mask.data_ptr()] = classify(function, kwargs.get("local_size"), mask.device)
        return mask

    def record_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: object,
        **kwargs: object,
    ):
        index, mask = getattr(module, "layer_idx", None), attention_mask
        kind = CAUSAL if mask is None else masks.get(mask.data_ptr()) if isinstance(mask, torch.Tensor) else None
        if kind is None:
            unknown_masks.append(index)
        if isinstance(index, int):
            found[index] = _spec(index, module, query, key, value, kind or CAUSAL, kwargs, reference_impl)
            found[index].module = names.get(id(module), "")
        return torch.zeros(
            query.shape[0], query.shape[2], query.shape[1], value.shape[3], dtype=query.dtype, device=query.device
        ), None

    AttentionInterface.register(PROBE_NAME, record_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_NAME, record_mask)
    model.set_attn_implementation(PROBE_NAME)
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[0, 1]], device=model.device), use_cache=False)
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    return _check(model, found, unknown_masks)


def classify(function: object, local_size: object, device: torch.device | str = "cpu") -> MaskKind:
    """The mask a model built, named: plain causal (evaluated, so a causal mask combined with no-op
    overlays counts), a sliding window, chunks, or another pattern kept as the function itself.
    Evaluated on the model's device: a mask function may hold tensors of its own there (llama4's
    chunks keep the batch's left padding)."""
    if function is causal_mask_function:
        return CAUSAL
    size = local_size if isinstance(local_size, int) and local_size > 0 else None
    n = 3 * (size or 16)
    q, k = torch.arange(n, device=device).unsqueeze(1), torch.arange(n, device=device).unsqueeze(0)
    zero = torch.zeros((), dtype=torch.long, device=device)
    try:
        got = function(zero, zero, q, k).expand(n, n)
    except Exception as exc:  # a pattern only vmap can evaluate: no per-sequence mask can be made from it
        raise UnsupportedModel(
            f"its attention mask function cannot be evaluated per sequence ({type(exc).__name__}: {exc})"
        ) from None
    causal = k <= q
    if bool((got == causal).all()):
        return CAUSAL
    if size is not None and bool((got == (causal & (k > q - size))).all()):
        return MaskKind(function, size, f"sliding window {size}")
    if size is not None and bool((got == (causal & (k // size == q // size))).all()):
        return MaskKind(function, size, f"chunked attention, {size}-token chunks")
    return MaskKind(function, size, "a custom mask")


def _spec(
    index: int,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kind: MaskKind,
    kwargs: dict,
    impl: str,
) -> LayerSpec:
    features = []
    if kwargs.get("softcap") is not None:
        features.append(f"attention softcap {kwargs['softcap']}")
    if kwargs.get("s_aux") is not None:
        features.append("attention sinks")
    reference, sdpa = sdpa_attention_forward, impl == "sdpa"
    if not sdpa:  # the model's own eager attention: softcaps and sinks are applied there
        reference = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if reference is None:
            raise UnsupportedModel(
                f"it runs {impl!r} attention and its module has no eager_attention_forward to compute it with"
            )
    return LayerSpec(
        index,
        query.shape[1],
        key.shape[1],
        key.shape[3],
        value.shape[3],
        kind,
        tuple(features),
        reference,
        not sdpa,
        sdpa,
    )


def _check(model: torch.nn.Module, found: dict[int, LayerSpec], unknown_masks: list) -> list[LayerSpec]:
    text = model.config.get_text_config()
    layers = getattr(text, "num_hidden_layers", None) or len(found)
    if not found:
        raise UnsupportedModel(
            "its attention does not go through transformers' attention interface, so its keys and values never reach the paged KV cache"
        )
    missing = sorted(set(range(layers)) - found.keys())
    if missing:
        types = getattr(text, "layer_types", None) or []
        kinds = sorted({types[i] for i in missing if i < len(types)}) or ["no attention"]
        raise UnsupportedModel(
            f"layers {', '.join(map(str, missing[:8]))}{'...' if len(missing) > 8 else ''} of {layers} ({', '.join(kinds)}) never call attention: "
            "they carry a state from token to token, which a paged KV cache does not hold"
        )
    if len(found) != layers or unknown_masks:
        raise UnsupportedModel(
            "it builds attention masks of its own outside transformers' masking utilities, which the worker cannot reproduce per sequence"
        )
    return [found[i] for i in range(layers)]
