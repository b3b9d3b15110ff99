"""One tiny random model per family, built from transformers' own config classes (no hub).

Hidden 64, 2 layers, vocab 256, seeded; every feature that changes attention is switched on small
enough that the tests' prompts (12-37 tokens) pass it: sliding windows and attention chunks of 8
tokens, softcaps, sinks, biases (drawn at random: transformers initialises them to zero, which would
hide a dropped bias). ``SERVED`` are the families a worker serves; ``REFUSED`` those it refuses,
with a phrase the refusal must contain.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

WINDOW = 8
# Applied where the config class has the field (each family names its sizes differently).
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    n_embd=64,
    n_layer=2,
    n_head=4,
    n_positions=512,
    d_model=64,
    n_layers=2,
    n_heads=4,
    ffn_hidden_size=128,
    max_seq_len=512,
    moe_intermediate_size=32,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    shared_expert_intermediate_size=32,
    rotary_dim=8,
    partial_rotary_factor=0.5,
)
W = WINDOW
SERVED: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),  # the native forward's own o_proj bias
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "mixtral": ("mixtral", dict(sliding_window=W)),
    "gemma": ("gemma", {}),
    "gemma2": (
        "gemma2",
        dict(sliding_window=W, query_pre_attn_scalar=24, final_logit_softcapping=3.0, attn_logit_softcapping=2.0),
    ),
    "gemma3_text": ("gemma3_text", dict(sliding_window=W, sliding_window_pattern=2, query_pre_attn_scalar=24)),
    "granite": ("granite", {}),
    "granitemoe": ("granitemoe", {}),
    "phi": ("phi", {}),
    "phi3": ("phi3", dict(sliding_window=W)),
    "phimoe": ("phimoe", dict(sliding_window=W)),
    "olmo": ("olmo", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", dict(sliding_window=W)),
    "olmoe": ("olmoe", {}),
    "cohere": ("cohere", {}),
    "cohere2": ("cohere2", dict(sliding_window=W)),
    "smollm3": ("smollm3", {}),
    "starcoder2": ("starcoder2", dict(sliding_window=W)),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "glm": ("glm", {}),
    "glm4": ("glm4", {}),
    "internlm3": ("internlm3", {}),
    "ernie4_5": ("ernie4_5", {}),
    "helium": ("helium", {}),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", {}),
    "seed_oss": ("seed_oss", {}),
    "apertus": ("apertus", {}),
    "arcee": ("arcee", {}),
    "mistral": ("mistral", dict(sliding_window=W)),
    "ministral": ("ministral", dict(sliding_window=W)),
    "exaone4": ("exaone4", dict(sliding_window=W)),
    "gpt_oss": ("gpt_oss", dict(sliding_window=W)),
    "llama4_text": ("llama4_text", dict(attention_chunk_size=W, intermediate_size_mlp=128)),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "gptj": ("gptj", {}),
    "codegen": ("codegen", {}),
    "opt": ("opt", dict(word_embed_proj_dim=64, ffn_dim=128)),
    "persimmon": ("persimmon", {}),
    "stablelm": ("stablelm", {}),
    "nemotron": ("nemotron", {}),
    "deepseek_v3": (  # multi-head latent attention: keys 24 wide, values 16
        "deepseek_v3",
        dict(
            head_dim=8,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
        | dict(first_k_dense_replace=1, n_group=1, topk_group=1),
    ),
}
_BYPASS = "does not go through transformers' attention interface"
_STATE = "carry a state from token to token"
REFUSED: dict[str, tuple[str, dict, str]] = {
    "falcon": ("falcon", dict(head_dim=None), _BYPASS),
    "falcon-new-decoder": ("falcon", dict(head_dim=None, new_decoder_architecture=True, num_kv_heads=2), _BYPASS),
    "gpt_neo": ("gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=W), _BYPASS),
    "bloom": ("bloom", {}, _BYPASS),
    "mpt": ("mpt", {}, _BYPASS),
    "lfm2": ("lfm2", dict(layer_types=["conv", "full_attention"]), _STATE),
    "qwen3_next": ("qwen3_next", dict(layer_types=["linear_attention", "full_attention"]), _STATE),
    "mamba": ("mamba", {}, "recurrent"),
}


def family_config(model_type: str, extra: dict) -> object:
    """The family's config class with ``COMMON`` sizes where it has the field, then ``extra``
    (a None in ``extra`` leaves the class default: Falcon's head_dim is computed). A ``COMMON``
    size that is another name of a field ``extra`` sets (``num_local_experts`` for ``num_experts``)
    is left out, so that ``extra`` wins."""
    default = AutoConfig.for_model(model_type)
    aliases = getattr(default, "attribute_map", {})
    chosen = {aliases.get(name, name) for name in extra}
    common = {n: v for n, v in COMMON.items() if hasattr(default, n) and aliases.get(n, n) not in chosen}
    settings = common | extra
    return AutoConfig.for_model(model_type, **{name: value for name, value in settings.items() if value is not None})


def build(model_type: str, extra: dict, folder: Path, seed: int = 0) -> PreTrainedModel:
    """A seeded random model of the family, saved to ``folder`` (what a worker loads); biases and
    sinks drawn at random so that a path that drops them gives other tokens."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(model_type, extra)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                parameter.normal_(0, 0.2)
    model.generation_config.eos_token_id = (
        None  # generate runs to max_new_tokens, as the engine's requests with ignore_eos
    )
    model.save_pretrained(folder)
    return model


# Families whose GGUF files transformers reads back (transformers/integrations/ggml.py), with only
# what such a file carries: transformers reads no softcap, query_pre_attn_scalar or window pattern
# from a Gemma file, no window from a Phi-3 or Mistral file (llama.cpp writes Mistral as a Llama),
# so those stay at their defaults here (a real Gemma 2's), and Gemma's windows cut through the
# ``sliding_window`` the file does carry.
GGUF: dict[str, tuple[str, dict]] = {
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "gemma2": ("gemma2", dict(sliding_window=W)),
    "gemma3_text": ("gemma3_text", dict(sliding_window=W)),
}
_GGUF_ARCH = {"mistral": "llama", "gemma3_text": "gemma3"}  # llama.cpp's name where it differs
_NORM_PLUS_ONE = {"gemma2", "gemma3"}  # llama.cpp stores Gemma's 1 + w norm scales as they multiply


def _gguf_kind(quantize: str, name: str, row: int) -> str:
    if name.startswith(("token_embd", "output.")):
        return "Q8_0"
    if quantize == "Q4_K_M":
        quantize = "Q8_0" if re.search(r"\.(attn_v|ffn_down)\.", name) else "Q4_K"
    return "Q8_0" if quantize == "Q4_K" and row % 256 else quantize  # K-quants: rows of 256 (llama.cpp falls back too)


def quantize_q4_k(x) -> object:
    """GGUF Q4_K blocks of ``x`` (rows a multiple of 256; gguf-py reads Q4_K but cannot write it):
    per 256 weights a float16 scale and minimum, and per 32 a 6-bit scale and minimum of those,
    w ~ d * sc * q - dmin * m with q in 0..15. Round to nearest, no search: a grid is all a test needs."""
    import numpy as np

    rows = x.reshape(-1, 256).astype(np.float32)
    sub = rows.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale, mins = (sub.max(-1) - low) / 15, -low
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(mins, dminf, out=np.zeros_like(mins), where=dminf > 0)), 0, 63).astype(np.uint8)
    step, base = (df * sc)[..., None], (dminf * mn)[..., None]
    q = np.clip(np.round(np.divide(sub + base, step, out=np.zeros_like(sub), where=step > 0)), 0, 15).astype(np.uint8)
    scales = np.zeros((rows.shape[0], 12), np.uint8)  # llama.cpp's packing of eight 6-bit pairs
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(rows.shape[0], 128)
    blocks = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs]
    return np.concatenate(blocks, axis=1).reshape(*x.shape[:-1], x.shape[-1] // 256 * 144)


def write_gguf(model: PreTrainedModel, path: Path, quantize: str | None = None, extra: dict | None = None) -> Path:
    """``model`` as a GGUF file, written the way llama.cpp's convert_hf_to_gguf.py writes it for the
    families in ``GGUF`` (gguf's own tensor map; Llama-arch q/k rows permuted for its rotary, Gemma's
    norms shifted by 1, a tied head left out). ``quantize`` ("Q4_0", "Q4_1", "Q4_K", ...): the
    projections in that type, embeddings and head in Q8_0 (as llama.cpp's 4-bit files keep them at 8
    bits or more); "Q4_K_M": Q4_K but attention values and FFN downs at 8 bits (llama.cpp's Q4_K_M
    keeps them in Q6_K, which gguf cannot write either); None: everything float32. ``extra``: more metadata
    fields (name: unsigned int)."""
    import gguf
    import numpy as np

    config = model.config
    arch = _GGUF_ARCH.get(config.model_type, config.model_type)
    rope = config.rope_parameters
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{config.model_type}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(
        config.bos_token_id
    )  # the vocabulary's special tokens (Phi-3's defaults lie past a tiny one)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    if arch in _NORM_PLUS_ONE:
        writer.add_sliding_window(config.sliding_window)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    tied = config.tie_word_embeddings
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        data = tensor.float().numpy()
        if arch == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):
            heads = config.num_attention_heads if ".attn_q." in gguf_name else config.num_key_value_heads
            data = data.reshape(heads, 2, -1, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)
        if arch in _NORM_PLUS_ONE and gguf_name.endswith("norm.weight"):
            data = data + 1
        kind = None
        if quantize is not None and data.ndim == 2:
            kind = _gguf_kind(quantize, gguf_name, data.shape[1])
            if kind == "Q4_K":
                data = quantize_q4_k(data)
            else:
                data = gguf.quants.quantize(np.ascontiguousarray(data), gguf.GGMLQuantizationType[kind])
            kind = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(gguf_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
