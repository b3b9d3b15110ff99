"""Tiny random vision-language models built in-test (seeded, hidden 64, 2 layers; more in
more_models.py), each saved with its processor (the PIL image processor: no torchvision here) and
a chat template that reads image parts, as a checkpoint on the hub comes; and the reference
answers of transformers' ``generate``."""

from __future__ import annotations

import functools
import io
import json
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText

IMAGE_SIZE = 32  # pixels a side after the processor's resize: 16 patches of 8

# LLaVA-1.5's template shape, with ``{"type": "image"}`` parts rendered as the processor's token.
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | upper }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def build_llava(tokenizer, folder: Path, seed: int = 0) -> torch.nn.Module:
    """LLaVA: a tiny Llama decoder and a tiny CLIP vision tower, with ``LlavaProcessor``."""
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = with_image_token(tokenizer, "<image>")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = text_config(tokenizer)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=8, projection_dim=32,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id, projector_hidden_act="gelu"
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None  # generate runs to max_new_tokens, as requests with ignore_eos
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
        chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1,
    )  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def build_idefics3(tokenizer, folder: Path, seed: int = 0, kind: str = "Idefics3") -> torch.nn.Module:
    """Idefics3 or SmolVLM (``kind``): a tiny Llama decoder and SigLIP tower, pixel-shuffled 4 tokens
    an image between its ``<fake_token_around_image>`` and ``<global-img>`` markers, with its
    processor (no image splitting; SmolVLM's config written as the hub has it, its processor wanting
    torchvision for its video half)."""
    import transformers

    tokenizer = with_image_token(tokenizer, ["<image>", "<fake_token_around_image>", "<global-img>"])
    text = text_config(tokenizer).to_dict()
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8
    )  # fmt: skip
    config = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    config.architectures = [f"{kind}ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).eval()
    model.generation_config.eos_token_id = None
    edge = {"longest_edge": IMAGE_SIZE}
    images = getattr(transformers, f"{kind}ImageProcessorPil")(do_image_splitting=False, size=edge, max_image_size=edge)
    model.save_pretrained(folder)
    if kind == "Idefics3":
        processor = transformers.Idefics3Processor(
            image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=LLAVA_TEMPLATE
        )
        processor.save_pretrained(folder)
    else:
        save_image_half(folder, tokenizer, images, f"{kind}Processor", LLAVA_TEMPLATE, image_seq_len=4)
    return model


def save_image_half(folder: Path, tokenizer, images, processor_class: str, template: str, **options) -> None:
    """A processor's files as the hub has them, where its class does not construct here (its video
    processor needs torchvision): the tokenizer, the image processor and ``processor_config.json``."""
    tokenizer.save_pretrained(folder)
    images.save_pretrained(folder)
    config = {"processor_class": processor_class, "image_processor": images.to_dict(), **options}
    (folder / "processor_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)


def with_image_token(tokenizer, tokens: str | list[str]):
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [tokens] if isinstance(tokens, str) else tokens})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def text_config(tokenizer, family: str = "llama", **extra) -> object:
    """The decoder: families.py's tiny ``family`` (Llama) over the tokenizer's vocabulary and its special tokens."""
    from tests.worker.families import family_config

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return family_config(family, dict(vocab_size=len(tokenizer)) | ids | extra)


def image_bytes(seed: int, size: tuple[int, int] = (40, 48), fmt: str = "PNG") -> bytes:
    """A seeded random RGB image, encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


@functools.cache
def processor(folder: Path) -> object:
    """The model's processor as the gateway builds it (Qwen-VL's without its video half, Pixtral's imported for real)."""
    from transformers import AutoTokenizer

    from common.processors import load_processor

    return load_processor(str(folder), AutoTokenizer.from_pretrained(folder))


def render(processor, messages: list[dict]) -> str:
    """The conversation through the model's chat template (the processor's, else the tokenizer's)."""
    template = getattr(processor, "chat_template", None)
    return processor.tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )


@functools.cache
def _loaded(folder: Path) -> tuple[object, torch.nn.Module]:
    return processor(folder), AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def reference(folder: Path, messages: list[dict], images: list[bytes], max_new_tokens: int) -> list[int]:
    """transformers' greedy answer, float32: the processor's ids and pixels (with the model's options)
    into ``generate``."""
    from PIL import Image

    processor, model = _loaded(folder)
    text = render(processor, messages)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil or None, add_special_tokens=False, return_tensors="pt", **options(folder))
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


QWEN_TEMPLATE = LLAVA_TEMPLATE.replace("<image>\n", "<|vision_start|><|image_pad|><|vision_end|>")


def build_qwen_vl(tokenizer, folder: Path, seed: int = 0, kind: str = "qwen2_vl") -> torch.nn.Module:
    """Qwen2-VL or Qwen2.5-VL (``kind``): a tiny M-RoPE decoder and its vision tower (8-pixel patches,
    2x2 merged), with the PIL image processor and the processor's config as the hub has it (the
    processor itself wants torchvision for its video half)."""
    import transformers

    prefix = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL", "qwen3_vl_moe": "Qwen3VLMoe"}[
        kind
    ]
    tokenizer = with_image_token(tokenizer, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    ids = {
        t: tokenizer.convert_tokens_to_ids(f"<|{t}|>") for t in ("vision_start", "vision_end", "image_pad", "video_pad")
    }
    text = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(tokenizer), max_position_embeddings=512, rope_parameters={"rope_type": "default",
        "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(depth=2, num_heads=2, patch_size=8, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64)
    if kind == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=64)
    elif kind == "qwen2_5_vl":
        vision.update(hidden_size=32, intermediate_size=64, window_size=16, fullatt_block_indexes=[1])
    else:  # Qwen3-VL: DeepStack features from the tower's first layer into the decoder's first
        vision.update(hidden_size=32, intermediate_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0])
        text.update(head_dim=16, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})
        if kind == "qwen3_vl_moe":  # its decoder's MLPs are 4 experts, 2 a token
            text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = getattr(transformers, f"{prefix}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"],
    )  # fmt: skip
    config.architectures = [f"{prefix}ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForConditionalGeneration")(config).eval()
    model.generation_config.eos_token_id = None
    images = transformers.Qwen2VLImageProcessorPil(
        min_pixels=16 * 16, max_pixels=48 * 48, patch_size=8, merge_size=2, temporal_patch_size=2
    )
    model.save_pretrained(folder)
    processor = "Qwen3VLProcessor" if kind == "qwen3_vl_moe" else f"{prefix}Processor"  # the MoE has none of its own
    save_image_half(folder, tokenizer, images, processor, QWEN_TEMPLATE)
    return model


# The processor's call options a model is served with (``--mm-processor-kwargs``), beside its files.
OPTIONS = "test_processor_kwargs.json"


def options(folder: Path) -> dict:
    """The processor options the model in ``folder`` is served with (none for most)."""
    return json.loads((folder / OPTIONS).read_text()) if (folder / OPTIONS).is_file() else {}
