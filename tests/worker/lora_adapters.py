"""Random LoRA adapters made with peft for the tests' tiny models: peft starts B at zero (a no-op
adapter that would prove nothing), so A and B are both drawn at random, seeded."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    model_dir: Path, folder: Path, seed: int, rank: int = 8, targets: list[str] = ALL, alpha: int = 16
) -> Path:
    """A peft adapter of the model saved in ``model_dir``, every A and B random (std 0.05), saved to ``folder``."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    peft_model.save_pretrained(folder)
    return folder


def merged(model_dir: Path, adapter: Path | None, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The base model with the adapter merged into its weights (peft's ``merge_and_unload``)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    if adapter is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()


def unmerged(model_dir: Path, adapter: Path) -> PreTrainedModel:
    """The base model with the adapter beside it (peft's own forward: base(x) + B(A(x)) * scale)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter).eval()


def default_model_adapter(folder: Path, seed: int) -> Path:
    """A random rank-4 adapter of q and v in the first layer of the default model (SmolLM2-135M: its
    projection shapes, one layer of its 30, a vocabulary it never touches): peft's files without
    loading the 135M model, for tests that need an adapter the server accepts, not its exact text."""
    from transformers import LlamaForCausalLM

    from tests.worker.families import family_config

    sizes = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    config = family_config("llama", sizes | dict(num_hidden_layers=1, vocab_size=64))
    torch.manual_seed(seed)
    base = folder.parent / f"{folder.name}-base"
    LlamaForCausalLM(config).save_pretrained(base)
    return make_adapter(base, folder, seed, rank=4, targets=["q_proj", "v_proj"])
