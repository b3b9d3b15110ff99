"""Images into an image-text model's prompt, through the model's own processor.

The worker sends its processor's files with the tokenizer (common/model_source.py); here they load
with the PIL image processors (``backend="pil"``): PyPI's torchvision is built for the CUDA torch
and fails to import beside the CPU one, and the gateway imports no torch. The chat template renders
each image part as the processor's image token; ``expand`` replaces each such token with what the
processor makes of it for that image (its placeholders, with any markers around them) and keeps
the processor's pixel values for the worker, which runs the vision encoder
(worker/models/vision.py). A processor whose expansion depends on the rest of the prompt
(``WHOLE_PROMPT``: Gemma 3, LLaVA-OneVision) runs once over the whole prompt instead; an image
that Gemma 3's pan-and-scan crops is one image over its runs (its own and one a crop), with their
pixels. The token counts are the processor's own, so ``/tokenize``, usage and the prompt budget
count image tokens as the model sees them.
"""

from __future__ import annotations

import hashlib
from typing import Any

from common.images import ImageInput, token_runs
from gateway.errors import InvalidRequest
from gateway.generate.media import MediaRules, load_image

_NOT_PIXELS = ("input_ids", "attention_mask", "pixel_values", "token_type_ids", "mm_token_type_ids")
# Processors whose expansion puts text around an image (Gemma 3's "\n\n" before and after it), which
# tokenizes with its neighbours: they expand the whole prompt at once, as generate's caller does.
# LLaVA-OneVision's tiles an image (anyres) only when the prompt holds one.
WHOLE_PROMPT = {"Gemma3Processor", "LlavaOnevisionProcessor"}


class Vision:
    """An image-text model's processor, as the gateway uses it (off the event loop)."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.image_token: str = processor.image_token
        self.image_token_id: int = processor.tokenizer.convert_tokens_to_ids(self.image_token)
        self.whole_prompt = type(processor).__name__ in WHOLE_PROMPT

    def expand(self, ids: list[int], images: list[Any], param: str = "messages") -> tuple[list[int], list[ImageInput]]:
        """``ids`` with each image token expanded for its image (in order), and the images' inputs."""
        where = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(where) != len(images):
            raise InvalidRequest(
                f"the prompt holds {len(where)} image placeholders for {len(images)} images "
                "(the chat template must render each image part once)",
                param=param,
            )
        if self.whole_prompt and images:
            return self._expand_whole(ids, images, param)
        out: list[int] = []
        inputs: list[ImageInput] = []
        last = 0
        for position, image in zip(where, images):
            out.extend(ids[last:position])
            got = self.processor(text=self.image_token, images=[image], add_special_tokens=False, return_tensors="np")
            expansion = [int(t) for t in got["input_ids"][0]]
            inputs.append(_image_input(got, len(out), len(expansion)))
            out.extend(expansion)
            last = position + 1
        out.extend(ids[last:])
        return out, inputs

    def _expand_whole(self, ids: list[int], images: list[Any], param: str) -> tuple[list[int], list[ImageInput]]:
        """The prompt's text through the processor with all its images (the ids as the reference
        tokenizes them); each image's share of the outputs (its pixel rows: the image and any
        pan-and-scan crops; its row of each other per-image output; the others whole) placed over
        its runs of image tokens (one, or one more a crop)."""
        import numpy as np

        processor = self.processor
        text = processor.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        got = processor(
            text=text,
            images=images,
            add_special_tokens=False,
            return_tensors="np",
            return_text_replacement_offsets=True,
        )
        out = [int(t) for t in got["input_ids"][0]]
        expanded = set(processor.image_token_ids) - {None} or {self.image_token_id}
        runs = token_runs(out, expanded)
        # each image's runs: one, or (Gemma 3's pan-and-scan) one more a crop, whose pixels are rows of their own
        replaced = got.pop("text_replacement_offsets", None)
        rows = [1] * len(images)
        if replaced:
            encode = processor.tokenizer.encode
            rows = [len(token_runs(encode(r["replacement"], add_special_tokens=False), expanded)) for r in replaced[0]]
        if len(rows) != len(images) or len(runs) != sum(rows):
            raise InvalidRequest(
                f"{len(images)} images with no text between some of them: put text between images", param=param
            )
        shared = set(getattr(processor, "unused_input_names", [])) | set(_NOT_PIXELS) - {"pixel_values"}
        outputs = {k: np.asarray(v) for k, v in got.items() if k not in shared}
        inputs = []
        for i, count in enumerate(rows):
            first = sum(rows[:i])
            alone = {k: v[i : i + 1] if len(v) == len(images) else v for k, v in outputs.items()}
            alone["pixel_values"] = outputs["pixel_values"][first : first + count]
            low, high = runs[first][0], runs[first + count - 1][1]
            inputs.append(_image_input(alone, low, high - low))
        return out, inputs


def _image_input(got: Any, offset: int, length: int) -> ImageInput:
    import numpy as np

    pixels = np.ascontiguousarray(got["pixel_values"], dtype="<f4")
    data = pixels.tobytes()
    extra = {k: np.asarray(v) for k, v in got.items() if k not in _NOT_PIXELS}
    digest = hashlib.sha256(data)  # and the shapes and sizes: the same bytes cut another way are another image
    digest.update(repr((pixels.shape, sorted((k, v.shape, v.tolist()) for k, v in extra.items()))).encode())
    return ImageInput(
        digest=digest.hexdigest(),
        offset=offset,
        length=length,
        pixels=data,
        shape=list(pixels.shape),
        extra={k: v.astype(np.int64).ravel().tolist() for k, v in extra.items()},
        extra_shapes={k: list(v.shape) for k, v in extra.items()},
    )


def image_part(url: str, param: str) -> dict[str, Any]:
    """An image content part as every dialect hands it to the core: chat templates read
    ``{"type": "image"}``; the URL and where the request gave it ride along."""
    return {"type": "image", "url": url, "param": param}


def parts_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content parts: text only, joined (what text templates read); with images, the
    parts as image-text templates read them."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def image_refs(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(url, param) of every image part, in prompt order."""
    return [
        (part["url"], part["param"])
        for message in messages
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if isinstance(part, dict) and part.get("type") == "image" and "url" in part
    ]


def check_images(vision: Vision | None, refs: list[tuple[str, str]], rules: MediaRules, model: str) -> None:
    """Images only for an image-text model, and no more than the server allows per request."""
    if refs and vision is None:
        param = refs[0][1]
        raise InvalidRequest(f"`{param}`: the model `{model}` does not take images (a text-only model)", param=param)
    if len(refs) > rules.max_images:
        raise InvalidRequest(
            f"the request holds {len(refs)} images; this server takes at most {rules.max_images} (--max-images-per-request)",
            param=refs[rules.max_images][1],
        )


def prompt_with_images(served: Any, refs: list[tuple[str, str]], *render: Any) -> tuple[list[int], list[ImageInput]]:
    """On a tokenize lane: fetch and decode the images, render and tokenize the conversation
    (``served.chat_prompt_ids(*render)``), and expand each image's token for its image."""
    check_images(served.vision, refs, served.media, served.served_name)
    images = [load_image(url, served.media, param) for url, param in refs]
    return served.vision.expand(served.chat_prompt_ids(*render), images)
