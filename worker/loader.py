"""Load a causal LM's weights (an image-text model's with its vision tower), caching de-quantized GGUF weights as safetensors.

De-quantizing the default GGUF model takes about 10 s on the CPU; loading the cached safetensors
takes about 0.15 s and gives bit-identical weights, so every worker start after the first is fast.
``cached_tensors`` does the same for tensors derived from them (the decode kernel's quantized copies).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file, save_model
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    PretrainedConfig,
    PreTrainedModel,
)

from common.model_source import ModelSource, save_to_cache
from worker.models.support import UnsupportedModel
from worker.models.vision import is_image_text

log = logging.getLogger(__name__)


def load_model(source: ModelSource, dtype: torch.dtype, cache_root: str) -> PreTrainedModel:
    """The model on the CPU in ``dtype``; from the conversion cache when there is one."""
    cached = source.cache_dir(cache_root, f"weights-{str(dtype).removeprefix('torch.')}")
    if cached is not None and (cached / "model.safetensors").is_file():
        log.info("loading converted weights from %s", cached)
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    fields = _gguf_fields(source)
    _refuse_image_gguf(source, fields)
    if source.gguf_file is None and is_image_text(AutoConfig.from_pretrained(source.path)):
        return AutoModelForImageTextToText.from_pretrained(source.path, dtype=dtype)  # worker/models/vision.py
    model = AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=dtype, **_gguf_head_dim(source, fields)
    )
    _refuse_lost_experts(fields, model)
    if cached is not None:
        try:
            _save_converted(model, cached)
        except OSError as exc:  # a read-only cache costs speed, not correctness
            log.warning("could not cache converted weights in %s: %s", cached, exc)
    return model


def _gguf_fields(source: ModelSource) -> dict | None:
    """The GGUF file's metadata fields (None: not a GGUF source)."""
    if source.gguf_file is None:
        return None
    from gguf import GGUFReader

    return GGUFReader(Path(source.path) / source.gguf_file).fields


def _refuse_image_gguf(source: ModelSource, fields: dict | None) -> None:
    """llama.cpp's image-text files (a language model plus a vision projector, ``mmproj``, of
    architecture ``clip``) are refused: transformers reads no projector file, and the language model
    alone would take no images."""
    if fields is None:
        return
    name = source.gguf_file
    if fields["general.architecture"].contents() == "clip":
        why = f"{name} is a vision projector (llama.cpp's mmproj file, architecture clip), not a language model"
    else:
        beside = sorted(p.name for p in Path(source.path).glob("*.gguf") if "mmproj" in p.name.lower())
        if not beside:
            return
        why = f"{name} comes with the vision projector {beside[0]} (llama.cpp's mmproj), which transformers cannot read"
    raise UnsupportedModel(
        f"an image-text GGUF model is not supported: {why}; serve the model's transformers checkpoint (safetensors) instead."
    )


def _refuse_lost_experts(fields: dict | None, model: PreTrainedModel) -> None:
    """A mixture of experts in llama.cpp's layout (Mixtral's files: the llama architecture plus
    expert tensors) that transformers built as a dense model would serve wrong text: refuse it."""
    experts = fields.get(f"{fields['general.architecture'].contents()}.expert_count") if fields else None
    if experts is None or int(experts.contents()) == 0:
        return
    config = model.config
    if not any(getattr(config, name, 0) for name in ("num_local_experts", "num_experts", "n_routed_experts")):
        raise ValueError(
            f"the GGUF file holds a mixture of {int(experts.contents())} experts, which transformers loaded as a "
            f"dense {type(model).__name__} (its expert weights dropped): it would serve wrong text. "
            "Serve the model's safetensors checkpoint instead"
        )


def _gguf_head_dim(source: ModelSource, fields: dict | None) -> dict[str, PretrainedConfig]:
    """A config with the file's head size where transformers reads none from the family's GGUF
    metadata (Qwen3: the class default, 128, whatever the file says, so a file with other heads
    fails to load); llama.cpp writes it as the key length. Empty: nothing to correct."""
    if fields is None:
        return {}
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = fields["general.architecture"].contents()
    read = GGUF_CONFIG_MAPPING.get(arch, {})
    key_length = fields.get(f"{arch}.attention.key_length")
    if key_length is None or "attention.key_length" in read or "head_dim" in read.values():
        return {}
    config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    if getattr(config, "head_dim", None) in (None, int(key_length.contents())):
        return {}
    config.head_dim = int(key_length.contents())
    return {"config": config}


def cached_tensors(folder: Path | None, build: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``build()``'s tensors, kept in ``folder`` the first time and read from there after (the decode
    kernel's quantized weights: 1.35 s to make for the default model on one core, 0.06 s to read).
    Without a folder (a model that needs no conversion cache) or where it cannot be written, ``build()``."""
    if folder is not None and (folder / "tensors.safetensors").is_file():
        try:
            return load_file(folder / "tensors.safetensors")
        except Exception as exc:  # a damaged file costs a rebuild, not the worker
            log.warning("could not read %s (%s); building them again", folder, exc)
            shutil.rmtree(folder, ignore_errors=True)  # else the new copy could not take its place
    tensors = build()
    if folder is not None:
        try:
            save_to_cache(folder, lambda tmp: save_file(tensors, str(tmp / "tensors.safetensors")))
        except Exception as exc:  # a full disk or a read-only cache costs speed, not the worker
            log.warning("could not cache tensors in %s: %s", folder, exc)
    return tensors


def _save_converted(model: PreTrainedModel, target: Path) -> None:
    """Cache the de-quantized model as config + safetensors."""

    def write(folder: Path) -> None:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are plain tensors now
        config.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        save_model(model, str(folder / "model.safetensors"))

    save_to_cache(target, write)
    log.info("cached converted weights in %s", target)
