"""Tiny random vision-language models built in-test (seeded, hidden 64, 2 layers), each saved with
its processor (the PIL image processor: no torchvision here) and a chat template that reads image
parts, as a checkpoint on the hub comes; and the reference answers of transformers' ``generate``."""

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


def build_idefics3(tokenizer, folder: Path, seed: int = 0, kind: str = "Idefics3") -> torch.nn.Module:
    """Idefics3 or SmolVLM (``kind``): a tiny Llama decoder and SigLIP tower, pixel-shuffled 4 tokens
    an image between its ``<fake_token_around_image>`` and ``<global-img>`` markers, with its
    processor (no image splitting; SmolVLM's config written as the hub has it, its processor wanting
    torchvision for its video half)."""
    import transformers

    tokenizer = _with_image_token(tokenizer, ["<image>", "<fake_token_around_image>", "<global-img>"])
    text = _text_config(tokenizer).to_dict()
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
        _save_image_half(folder, tokenizer, images, f"{kind}Processor", LLAVA_TEMPLATE, image_seq_len=4)
    return model


def _save_image_half(folder: Path, tokenizer, images, processor_class: str, template: str, **options) -> None:
    """A processor's files as the hub has them, where its class does not construct here (its video
    processor needs torchvision): the tokenizer, the image processor and ``processor_config.json``."""
    tokenizer.save_pretrained(folder)
    images.save_pretrained(folder)
    config = {"processor_class": processor_class, "image_processor": images.to_dict(), **options}
    (folder / "processor_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)


def _with_image_token(tokenizer, tokens: str | list[str]):
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [tokens] if isinstance(tokens, str) else tokens})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _text_config(tokenizer, family: str = "llama", **extra) -> object:
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
    """transformers' greedy answer, float32: the processor's ids and pixels into ``generate``."""
    from PIL import Image

    processor, model = _loaded(folder)
    text = render(processor, messages)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=text, images=pil or None, add_special_tokens=False, return_tensors="pt")
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
    tokenizer = _with_image_token(tokenizer, ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
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
    _save_image_half(folder, tokenizer, images, processor, QWEN_TEMPLATE)
    return model


PROJECTION_SCALE = 0.1
GEMMA3_TEMPLATE = LLAVA_TEMPLATE.replace("<image>\n", "<start_of_image>")


def build_gemma3(tokenizer, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Gemma 3: a tiny Gemma 3 decoder (sliding-window and global layers) and SigLIP tower pooled to
    4 tokens an image, between ``<start_of_image>`` and ``<end_of_image>``, with ``Gemma3Processor``."""
    import transformers

    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = _with_image_token(tokenizer, list(marks.values()))
    tokenizer._set_model_specific_special_tokens(special_tokens=marks)  # the processor reads them by name
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in marks.items()}
    text = _text_config(tokenizer, "gemma3_text", sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24)
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4, boi_token_index=ids["boi_token"],
        eoi_token_index=ids["eoi_token"], image_token_index=ids["image_token"],
    )  # fmt: skip
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers starts its projection at zeros: images would change nothing
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=PROJECTION_SCALE)
    model.generation_config.eos_token_id = None
    images = transformers.Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA3_TEMPLATE
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def build_llava_onevision(tokenizer, folder: Path, seed: int = 0) -> torch.nn.Module:
    """LLaVA-OneVision: a tiny Llama decoder and SigLIP tower over anyres tiles of 32 pixels (a lone
    image tiled, each of several not), with its processor's files as the hub has them (the class
    wants torchvision for its video half)."""
    import transformers

    tokenizer = _with_image_token(tokenizer, ["<image>", "<video>"])
    grid = [[32, 32], [32, 64], [64, 32], [64, 64]]
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8
    )  # fmt: skip
    config = transformers.LlavaOnevisionConfig(
        text_config=_text_config(tokenizer).to_dict(), vision_config=vision, image_grid_pinpoints=grid,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), video_token_id=tokenizer.convert_tokens_to_ids("<video>"),
        vision_feature_select_strategy="full", vision_feature_layer=-1,
    )  # fmt: skip
    config.architectures = ["LlavaOnevisionForConditionalGeneration"]
    torch.manual_seed(seed)
    model = transformers.LlavaOnevisionForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    images = transformers.LlavaOnevisionImageProcessorPil(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_grid_pinpoints=grid
    )
    model.save_pretrained(folder)
    options = dict(num_image_tokens=16, vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_9")
    _save_image_half(folder, tokenizer, images, "LlavaOnevisionProcessor", LLAVA_TEMPLATE, **options)
    return model


MISTRAL3_TEMPLATE = LLAVA_TEMPLATE.replace("<image>\n", "[IMG]")


def build_mistral3(tokenizer, folder: Path, seed: int = 0, kind: str = "mistral3") -> torch.nn.Module:
    """Mistral 3, or Pixtral (``kind``: LLaVA's class with a Pixtral tower): a tiny Mistral decoder and
    Pixtral tower (2-D rotary over 8-pixel patches, each image at its own size up to 48 pixels, or 32),
    for Mistral 3 2x2 patches merged a token; each row of ``[IMG]`` ends in ``[IMG_BREAK]``, the image
    in ``[IMG_END]``, with transformers' ``PixtralProcessor`` on PIL."""
    import transformers

    from common.processors import pixtral_class

    marks = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tokenizer = _with_image_token(tokenizer, marks)
    merge, edge = (2, 48) if kind == "mistral3" else (1, 32)
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=edge, patch_size=8,
    )  # fmt: skip
    text, image_token = _text_config(tokenizer, "mistral").to_dict(), tokenizer.convert_tokens_to_ids(marks[0])
    if kind == "mistral3":
        config = transformers.Mistral3Config(
            text_config=text, vision_config=vision, spatial_merge_size=merge, image_token_index=image_token
        )
    else:  # as mistral-community/pixtral-12b has it
        config = transformers.LlavaConfig(
            text_config=text, vision_config=vision, image_token_id=image_token, vision_feature_select_strategy="full"
        )
    config.architectures = [
        "Mistral3ForConditionalGeneration" if kind == "mistral3" else "LlavaForConditionalGeneration"
    ]
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config).eval()
    model.generation_config.eos_token_id = None
    images = transformers.PixtralImageProcessorPil(size={"longest_edge": edge}, patch_size=8 * merge)
    processor = pixtral_class()(
        image_processor=images, tokenizer=tokenizer, patch_size=8, spatial_merge_size=merge, chat_template=MISTRAL3_TEMPLATE,
        image_token=marks[0], image_break_token=marks[1], image_end_token=marks[2],
    )  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model
