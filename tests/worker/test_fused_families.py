"""The fused C++ decode step for every family it knows, against transformers' own forward of the same
weights: tiny random models (seeded, 2 layers) with every feature switched on where the config has
it (sliding windows of 8 tokens under 40-token prompts, softcaps, partial rotary, experts), and
norm weights moved off their initial values so that a misread norm shows.

The step runs the whole prompt as rows (each token with its own context length, as prompt chunks
beside decodes do), so every position's logits are compared, windows cut and all."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.worker.families import family_config
from worker import kernels
from worker.models.family import FAST_FAMILIES, describe
from worker.models.fused_decode import FusedDecode
from worker.models.shapes import NotFast

pytestmark = pytest.mark.skipif(not kernels.load(), reason="needs the C++ kernels")

SIZES = dict(vocab_size=128, pad_token_id=0, bos_token_id=0, eos_token_id=0)  # beyond families.py's COMMON
FEATURES = {  # what each family switches on beyond the sizes
    "mistral": {"sliding_window": 8},
    "ministral": {"sliding_window": 8},
    "gemma2": {"sliding_window": 8},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "qwen3": {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
    "starcoder2": {"sliding_window": 8},
    "exaone4": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "olmo3": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "cohere2": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {"partial_rotary_factor": 0.5},
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
    },
    "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2},
    "smollm3": {"no_rope_layers": [1, 0]},
    "granite": {
        "embedding_multiplier": 3.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 2.0,
    },
}
PROMPT = 40


def tiny(kind: str, **extra: object) -> torch.nn.Module:
    config = family_config(kind, SIZES | FEATURES.get(kind, {}) | extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():  # norms at their initial values (1, or 0 with Gemma's 1 + w) would hide a misread one
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def fused_logits(model: torch.nn.Module, fused: FusedDecode, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every prompt position's logits from the step, with the prompt as rows over a paged cache."""
    family, n, block = fused.family, ids.numel(), 4
    blocks = -(-n // block)
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(2)).tolist()  # pages in no particular order
    caches = [
        tuple(torch.zeros(blocks, block, family.kv_heads, family.head_dim, dtype=dtype) for _ in range(2))
        for _ in family.layers
    ]
    positions = torch.arange(n)
    slots = torch.tensor([order[p // block] * block + p % block for p in range(n)])
    tables = torch.tensor([order] * n)
    return fused(ids, positions, caches, slots, tables, positions + 1)


@pytest.mark.parametrize("kind", sorted(FAST_FAMILIES))
def test_the_fused_step_computes_what_transformers_computes(ops, kind):
    """On every kernel variant this CPU executes (``ops``)."""
    model = tiny(kind)
    fused = FusedDecode(model, "none")
    fused.ops = ops
    ids = torch.randint(1, SIZES["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids[None]).logits[0].float()
    got = fused_logits(model, fused, ids, torch.float32)
    assert (got - want).abs().max().item() < 1e-5 * (1 + want.abs().max().item())
    if kind == "llama":  # plain rotary: its rows come from the step's table (RopeRows), not the module each step
        assert fused.rope is not None
    if any(layer.window for layer in fused.family.layers):
        assert PROMPT > min(layer.window for layer in fused.family.layers if layer.window), "the window must really cut"


@pytest.mark.parametrize("kind", ["qwen3", "gemma2", "mixtral"])
@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_weights_stay_close(kind, quantization):
    """bf16 caches and quantized weights: each position's top token is in transformers' top 5
    (vLLM's closeness rule, here per position of a teacher-forced prompt). A random model this small
    has nearly flat logits, and 4-bit weights over 64 inputs are coarse: q4 may miss at 1 in 20."""
    model = tiny(kind)
    fused = FusedDecode(model, quantization)
    ids = torch.randint(1, SIZES["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids[None]).logits[0].float()
    got = fused_logits(model, fused, ids, torch.bfloat16)
    top5 = want.topk(5, dim=-1).indices
    close = (top5 == got.argmax(-1, keepdim=True)).any(-1).float().mean().item()
    assert close >= (1.0 if quantization == "int8" else 0.95), close


@pytest.mark.parametrize(
    ("kind", "why"),
    [
        ("arcee", "activation"),  # ReLU squared
        ("nemotron", "norm"),  # LayerNorm with 1 + w
        ("llama4_text", "model type"),
        ("gpt_oss", "model type"),
    ],
)
def test_what_the_step_does_not_know_is_named(kind, why):
    extra = {"num_local_experts": 2, "num_experts_per_tok": 1} if kind == "llama4_text" else {}
    if kind == "arcee" or kind == "nemotron":
        pytest.importorskip(f"transformers.models.{kind}")
        from worker.models import family

        family.FAST_FAMILIES.add(kind)  # past the allowlist: the measurement must refuse it
        try:
            with pytest.raises(NotFast, match=why):
                describe(tiny(kind))
        finally:
            family.FAST_FAMILIES.discard(kind)
        return
    with pytest.raises(NotFast, match=why):
        describe(tiny(kind, **extra))
