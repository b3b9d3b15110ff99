"""A decoder-only model described by how it differs from Llama, in the terms of the fused decode step.

The C++ step (worker/kernels/decode_step.cpp) is one kernel for every family it knows; this module
reads a loaded transformers model into those terms: the norm kind (RMS, with Gemma's ``1 + w``, or
LayerNorm) and where the norms sit, the activation and whether the MLP is gated, biases, q/k norms
per head or over the whole projection, partial rotary and per-layer rotary tables (or none),
sliding windows, attention softcaps and scales, embedding, residual and logit multipliers, and
experts with top-k routing and a shared expert. What it cannot describe it names (``NotFast``); such
a model keeps transformers' own classes.

Where a detail is easy to get wrong it is measured, not assumed: each norm and activation is run on
random inputs against the candidates, so a family that rescales differently is refused here rather
than served wrong.
"""

from __future__ import annotations

import torch

from worker.models.measure import activation, check_mlp, norm, rope_layout, rotary_tables
from worker.models.shapes import QK_NONE, QK_PER_HEAD, QK_WHOLE, RMS, SILU, Family, Layer, Norm, NotFast

# The families the step has been checked against, token for token in float32 (tests/worker/test_fused_families.py).
FAST_FAMILIES = {
    "llama", "qwen2", "qwen3", "mistral", "ministral", "gemma", "gemma2", "gemma3_text", "phi3", "phi", "granite", "olmo2",
    "olmo3", "exaone4", "cohere2", "smollm3", "starcoder2", "cohere", "helium", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
}  # fmt: skip
# The language models of image-text models whose decode rows the step takes (decoder at
# ``model.model.language_model`` or ``.text_model``, the head outside), each checked in
# tests/vision/test_vision_step.py. M-RoPE's (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a generated token's
# three axes are equal, where its rotation is plain RoPE's (worker/runner/paths.py shifts the position
# past the images); Qwen3-VL's DeepStack adds features at image positions only, in prompt chunks.
IMAGE_TEXT_DECODERS = {
    "llama", "mistral", "ministral", "qwen2", "gemma3_text", "qwen2_vl_text", "qwen2_5_vl_text", "qwen3_vl_text",
    "qwen3_vl_moe_text",
}  # fmt: skip


def describe(model: torch.nn.Module) -> Family:
    """The model in the fused step's terms, or ``NotFast`` naming what it lacks."""
    config = model.config.get_text_config()
    kind = config.model_type
    if kind not in FAST_FAMILIES | IMAGE_TEXT_DECODERS:
        raise NotFast(f"model type {kind!r} is not among the fused decode step's families")
    decoder = text_decoder(model)  # after the family check: GPT-2-style models keep theirs elsewhere
    if getattr(config, "attention_chunk_size", None):
        raise NotFast("chunked attention")
    attn0 = decoder.layers[0].self_attn
    head_dim = attn0.head_dim
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    if head_dim % 16 or head_dim > 256 or heads % kv_heads or heads // kv_heads > 16:
        raise NotFast(
            f"heads of {head_dim} dims in groups of {heads // kv_heads} (the step takes multiples of 16 up to 256, groups up to 16)"
        )
    rope_types = _rope_types(config)
    rotary_dim = _rotary_dim(decoder, config, rope_types, head_dim)
    interleaved, halved = rope_layout(attn0, decoder, rope_types[0], rotary_dim)
    layers = [_layer(i, block, config, rope_types, head_dim) for i, block in enumerate(decoder.layers)]
    final = getattr(decoder, "norm", None) or getattr(decoder, "final_layernorm", None)
    head = model.lm_head
    return Family(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        halved=halved,
        rope_types=rope_types,
        embed_multiplier=float(getattr(config, "embedding_multiplier", 1.0) or 1.0),
        residual_multiplier=float(getattr(config, "residual_multiplier", 1.0) or 1.0),
        final_norm=norm(final, "final norm"),
        logit_multiplier=_logit_multiplier(config),
        final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
        lm_head_bias=None if head.bias is None else head.bias.detach().float(),
        layers=layers,
    )


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder the step runs: the model's own, or an image-text model's language model (its
    decode rows hold text tokens only, embedded by the plain token embedding; prompt chunks, which
    carry image features, stay on the torch path: worker/runner/paths.py)."""
    if getattr(model.config, "vision_config", None) is None:
        return model.model
    inner = model.model
    kind = model.config.get_text_config().model_type
    if kind not in IMAGE_TEXT_DECODERS:
        raise NotFast(f"an image-text model whose language model ({kind!r}) the step has not been checked against")
    if getattr(model.config.get_text_config(), "final_logit_softcapping", None):
        raise NotFast("an image-text model with a logit softcap (its wrapper's head does not apply it)")
    decoder = getattr(inner, "language_model", None) or getattr(inner, "text_model", None)
    if decoder is None or not hasattr(decoder, "layers") or not hasattr(model, "lm_head"):
        raise NotFast(f"an image-text model whose decoder the step does not find ({type(model).__name__})")
    return decoder


def _logit_multiplier(config: object) -> float:
    if getattr(config, "logits_scaling", None):  # Granite divides
        return 1.0 / config.logits_scaling
    return float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies


def _rope_types(config: object) -> list[str | None]:
    """One rotary table, or one per layer type when the config gives each its own (Gemma 3)."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        return sorted(set(config.layer_types) & params.keys())  # the model builds tables only for the types it has
    return [None]


def _rotary_dim(decoder: torch.nn.Module, config: object, rope_types: list[str | None], head_dim: int) -> int:
    """Partial rotary (Phi): the tables cover the first dims of each head only."""
    x = torch.zeros(1, 1, dtype=torch.float32)
    cos, _ = rotary_tables(decoder, x, torch.zeros(1, 1, dtype=torch.long), rope_types[0])
    if cos.shape[-1] > head_dim or cos.shape[-1] % 2:
        raise NotFast(f"rotary tables of {cos.shape[-1]} dims for heads of {head_dim}")
    return cos.shape[-1]


def _layer_type(config: object, index: int) -> str:
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _block_norms(block: torch.nn.Module, index: int) -> list[Norm | None]:
    """The block's norms before and after attention, and before and after the MLP."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    found = {name: getattr(block, name, None) for name in names}
    if found["pre_feedforward_layernorm"] is not None:  # Gemma 2/3: norms before and after each block
        modules = [found[name] for name in names]
    elif found["input_layernorm"] is None:  # OLMo 2: norms after each block only
        modules = [None, found["post_attention_layernorm"], None, found["post_feedforward_layernorm"]]
    else:  # before each block (in parallel blocks, the MLP's own or the shared one)
        modules = [found["input_layernorm"], None, found["post_attention_layernorm"], None]
    return [None if m is None else norm(m, f"layer {index} norm") for m in modules]


def _layer(index: int, block: torch.nn.Module, config: object, rope_types: list[str | None], head_dim: int) -> Layer:
    attn = block.self_attn
    layer_type = _layer_type(config, index)
    if layer_type not in ("full_attention", "sliding_attention"):
        raise NotFast(f"layer {index} is of type {layer_type!r}")
    q, k, v, qkv_bias = _qkv(attn, config, head_dim)
    o_mod = getattr(attn, "o_proj", None) or attn.dense
    parallel = _parallel(block, config)
    attn_norm, post_attn_norm, mlp_norm, post_mlp_norm = _block_norms(block, index)
    q_norm, k_norm, qk = _qk_norms(attn, head_dim)
    rope_set = _rope_set(config, index, layer_type, rope_types)
    window = (
        int(config.sliding_window)
        if layer_type == "sliding_attention" and getattr(config, "sliding_window", None)
        else 0
    )
    layer = Layer(
        attn_norm=attn_norm,
        post_attn_norm=post_attn_norm,
        mlp_norm=mlp_norm,
        post_mlp_norm=post_mlp_norm,
        qkv=[q, k, v],
        qkv_bias=qkv_bias,
        o=o_mod.weight.detach(),
        o_bias=None if o_mod.bias is None else o_mod.bias.detach().float(),
        q_norm=q_norm,
        k_norm=k_norm,
        qk_norm=qk,
        rope_set=rope_set,
        window=window,
        scale=float(attn.scaling),
        softcap=float(getattr(config, "attn_logit_softcapping", None) or 0.0),
        parallel=parallel,
        act=SILU,
        gated=True,
        up=None,
        up_bias=None,
        down=None,
        down_bias=None,
    )
    _mlp(block.mlp, layer, index)
    return layer


def _parallel(block: torch.nn.Module, config: object) -> bool:
    """Attention and MLP side by side on the same input: GPT-NeoX's flag, or one norm before both
    and none between them (Phi, Cohere)."""
    if getattr(config, "use_parallel_residual", False):
        return True
    return (
        hasattr(block, "input_layernorm")
        and not hasattr(block, "post_attention_layernorm")
        and not hasattr(block, "pre_feedforward_layernorm")
    )


def _qkv(
    attn: torch.nn.Module, config: object, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if hasattr(attn, "qkv_proj"):  # Phi-3: one projection, q then k then v
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        w = attn.qkv_proj.weight.detach()
        q, k, v = w.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach().float()
        return q, k, v, bias
    mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    bias = None
    if any(m.bias is not None for m in mods):
        bias = torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features) for m in mods]).detach().float()
    return mods[0].weight.detach(), mods[1].weight.detach(), mods[2].weight.detach(), bias


def _qk_norms(attn: torch.nn.Module, head_dim: int) -> tuple[Norm | None, Norm | None, int]:
    q_mod, k_mod = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_mod is None and k_mod is None:
        return None, None, QK_NONE
    q, k = norm(q_mod, "q norm"), norm(k_mod, "k norm")
    if q.kind != RMS or k.kind != RMS or q.bias is not None:
        raise NotFast("q/k norms other than RMS")
    if q.eps != k.eps:
        raise NotFast("q and k norms with different eps")
    return q, k, QK_PER_HEAD if q.weight.numel() == head_dim else QK_WHOLE


# Families whose full-attention layers have no rotary when the model has sliding windows.
NOPE_FULL_LAYERS = {"exaone4", "cohere2"}


def _rope_set(config: object, index: int, layer_type: str, rope_types: list[str | None]) -> int:
    no_rope = getattr(config, "no_rope_layers", None)
    if no_rope is not None and not no_rope[index]:  # SmolLM3: a 0 marks a layer without rotary
        return -1
    if (
        config.model_type in NOPE_FULL_LAYERS
        and getattr(config, "sliding_window", None)
        and layer_type == "full_attention"
    ):
        return -1
    return rope_types.index(layer_type) if rope_types != [None] else 0


def _mlp(mlp: torch.nn.Module, layer: Layer, index: int) -> None:
    if hasattr(mlp, "experts"):
        _experts(mlp, layer, index)
        return
    layer.act = activation(_act_fn(mlp), f"layer {index} MLP")
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: gate then up in one projection
        layer.up, layer.down = mlp.gate_up_proj.weight.detach(), mlp.down_proj.weight.detach()
        layer.up_bias = None if mlp.gate_up_proj.bias is None else mlp.gate_up_proj.bias.detach().float()
    elif hasattr(mlp, "gate_proj"):
        layer.up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        layer.down = mlp.down_proj.weight.detach()
        if mlp.gate_proj.bias is not None:
            layer.up_bias = torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias]).detach().float()
    else:  # plain MLP: fc1 (c_fc) -> act -> fc2 (c_proj)
        fc1, fc2 = (mlp.fc1, mlp.fc2) if hasattr(mlp, "fc1") else (mlp.c_fc, mlp.c_proj)
        layer.gated, layer.up, layer.down = False, fc1.weight.detach(), fc2.weight.detach()
        layer.up_bias = None if fc1.bias is None else fc1.bias.detach().float()
    down_mod = getattr(mlp, "down_proj", None) or getattr(mlp, "fc2", None) or getattr(mlp, "c_proj", None)
    layer.down_bias = None if down_mod.bias is None else down_mod.bias.detach().float()
    check_mlp(mlp, layer, index)


def _experts(mlp: torch.nn.Module, layer: Layer, index: int) -> None:
    experts, router = mlp.experts, mlp.gate
    layer.act = activation(experts.act_fn, f"layer {index} experts")
    layer.experts = [
        (experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()) for e in range(experts.gate_up_proj.shape[0])
    ]
    layer.router = router.weight.detach().float()
    layer.top_k = router.top_k
    layer.norm_top_k = bool(getattr(router, "norm_topk_prob", True))  # Mixtral's router always renormalises
    if getattr(router, "bias", None) is not None or getattr(mlp, "shared_experts", None) is not None:
        raise NotFast(f"layer {index}: a router bias or several shared experts")
    shared = getattr(mlp, "shared_expert", None)
    if shared is not None:
        if activation(_act_fn(shared), "shared expert") != layer.act:
            raise NotFast("a shared expert with its own activation")
        layer.up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight]).detach()
        layer.down = shared.down_proj.weight.detach()
        layer.shared_gate = mlp.shared_expert_gate.weight.detach().float()


def _act_fn(mlp: torch.nn.Module) -> torch.nn.Module:
    for name in ("act_fn", "activation_fn", "act"):
        if hasattr(mlp, name):
            return getattr(mlp, name)
    raise NotFast(f"an MLP without a known activation ({type(mlp).__name__})")
