"""Tiny random vision-language models built in-test (seeded, hidden 64, 2 layers), each saved with
its processor (the PIL image processor: no torchvision here) and a chat template that reads image
parts, as a checkpoint on the hub comes; and the reference answers of transformers' ``generate``."""

from __future__ import annotations

import functools
import io
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, AutoProcessor

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

    tokenizer = _with_image_token(tokenizer, "<image>")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    text = _text_config(tokenizer)
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


def build_idefics3(tokenizer, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Idefics3: a tiny Llama decoder and SigLIP tower, pixel-shuffled 4 tokens an image between its
    ``<fake_token_around_image>`` and ``<global-img>`` markers, with ``Idefics3Processor`` (no image splitting)."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tokenizer = _with_image_token(tokenizer, ["<image>", "<fake_token_around_image>", "<global-img>"])
    text = _text_config(tokenizer).to_dict()
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8
    )  # fmt: skip
    config = Idefics3Config(
        text_config=text,
        vision_config=vision,
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    config.architectures = ["Idefics3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    edge = {"longest_edge": IMAGE_SIZE}
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size=edge, max_image_size=edge)
    processor = Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=LLAVA_TEMPLATE
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def _with_image_token(tokenizer, tokens: str | list[str]):
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [tokens] if isinstance(tokens, str) else tokens})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _text_config(tokenizer) -> object:
    """The decoder of both: families.py's tiny Llama over the tokenizer's vocabulary and its special tokens."""
    from tests.worker.families import family_config

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return family_config("llama", dict(vocab_size=len(tokenizer)) | ids)


def image_bytes(seed: int, size: tuple[int, int] = (40, 48), fmt: str = "PNG") -> bytes:
    """A seeded random RGB image, encoded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


@functools.cache
def _loaded(folder: Path) -> tuple[object, torch.nn.Module]:
    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    return processor, AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


@torch.inference_mode()
def reference(folder: Path, messages: list[dict], images: list[bytes], max_new_tokens: int) -> list[int]:
    """transformers' greedy answer, float32: the processor's ids and pixels into ``generate``."""
    from PIL import Image

    processor, model = _loaded(folder)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil or None, add_special_tokens=False, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()
