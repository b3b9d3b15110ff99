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
