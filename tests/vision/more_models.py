"""More tiny image-text models (Gemma 3, LLaVA-OneVision, Mistral 3 and Pixtral), as models.py builds
the first ones: seeded, each saved with its processor (on PIL) and a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.vision.models import IMAGE_SIZE, LLAVA_TEMPLATE, OPTIONS, save_image_half, text_config, with_image_token

PROJECTION_SCALE = 0.1
GEMMA3_TEMPLATE = LLAVA_TEMPLATE.replace("<image>\n", "<start_of_image>")
# Gemma 3's pan-and-scan at the tests' sizes: an image over 1.5 times wider than high is also 2 crops.
PAN_AND_SCAN = dict(
    do_pan_and_scan=True,
    pan_and_scan_min_crop_size=16,
    pan_and_scan_max_num_crops=2,
    pan_and_scan_min_ratio_to_activate=1.5,
)


def build_gemma3(tokenizer, folder: Path, seed: int = 0) -> torch.nn.Module:
    """Gemma 3: a tiny Gemma 3 decoder (sliding-window and global layers) and SigLIP tower pooled to
    4 tokens an image, between ``<start_of_image>`` and ``<end_of_image>``, with ``Gemma3Processor``,
    run with pan-and-scan on (``OPTIONS``): a wide image is also 2 crops, 4 tokens each."""
    import transformers

    marks = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = with_image_token(tokenizer, list(marks.values()))
    tokenizer._set_model_specific_special_tokens(special_tokens=marks)  # the processor reads them by name
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in marks.items()}
    text = text_config(tokenizer, "gemma3_text", sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=24)
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
    (folder / OPTIONS).write_text(json.dumps(PAN_AND_SCAN))
    return model


def build_llava_onevision(tokenizer, folder: Path, seed: int = 0) -> torch.nn.Module:
    """LLaVA-OneVision: a tiny Llama decoder and SigLIP tower over anyres tiles of 32 pixels (a lone
    image tiled, each of several not), with its processor's files as the hub has them (the class
    wants torchvision for its video half)."""
    import transformers

    tokenizer = with_image_token(tokenizer, ["<image>", "<video>"])
    grid = [[32, 32], [32, 64], [64, 32], [64, 64]]
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=8
    )  # fmt: skip
    config = transformers.LlavaOnevisionConfig(
        text_config=text_config(tokenizer).to_dict(), vision_config=vision, image_grid_pinpoints=grid,
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
    save_image_half(folder, tokenizer, images, "LlavaOnevisionProcessor", LLAVA_TEMPLATE, **options)
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
    tokenizer = with_image_token(tokenizer, marks)
    merge, edge = (2, 48) if kind == "mistral3" else (1, 32)
    vision = dict(
        model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=edge, patch_size=8,
    )  # fmt: skip
    text, image_token = text_config(tokenizer, "mistral").to_dict(), tokenizer.convert_tokens_to_ids(marks[0])
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
