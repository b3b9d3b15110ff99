"""Image-text models (transformers' ``AutoModelForImageTextToText``): which families are served, and
their vision encoder run once per image at prefill.

The gateway's processor expands each image into its placeholder tokens and sends the pixel values
(common/protocol.ImageInput). Here the encoder turns each image into features once, in the step
whose prompt chunk first reaches it (while others decode, at most ``--max-encoder-images-per-step``
images a step: the scheduler ends a chunk before an image over that budget, so many images do not
make one long step for the streams beside them); an image's features are dropped once its tokens
are computed. Each chunk's embeddings take them at the positions that hold the model's image token,
as transformers' own forward puts them there (``masked_scatter`` in prompt order). The decoder then runs on ``inputs_embeds`` through the paged
attention, and decode steps are text as for any model.

Only families whose decoder sees an image as plain causal tokens are served: at ordinary positions,
or (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) at M-RoPE's 3-D positions, which ``positions`` takes from the
model's own ``get_rope_index``; Qwen3-VL's DeepStack features go in through ``_DeepStack``; Gemma 3's
image tokens attend to each other both ways (``BOTH_WAYS``, ``both_ways``); Mistral 3's and Pixtral's
images take features at their ``[IMG]`` positions only, not at the row and image ends around them. The others are refused at start by name (``REFUSED``), with the reason.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from common.images import ImageInput, token_runs
from worker.models.support import UnsupportedModel
from worker.request import Request

# Checked token for token against ``generate`` in float32 (tests/vision/test_vision_engine.py).
SERVED = {
    "llava",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma3",
    "mistral3",
}
# Families whose image tokens attend to each other both ways (each contiguous run of them, as transformers'
# ``token_type_ids`` mask makes it): the prompt chunks' attention opens up within a run (worker/attention/paged.py),
# and no chunk ends inside one (worker/scheduler.py), so each run is computed whole, as generate computes it.
BOTH_WAYS = {"gemma3"}

REFUSED: dict[str, str] = {
    "paligemma": "its prompt attends bidirectionally (prefix-LM), which the paged causal attention does not do",
    "mllama": "its images enter through cross-attention layers, whose keys the paged KV cache does not hold",
    "llama4": (
        "its class (Llama4ForConditionalGeneration) does not run in this transformers (its forward reads image_outputs "
        "from the language model's output: an AttributeError, even without images), so generate gives no answer to be "
        "exact against; and its image processor (Llama4ImageProcessor) exists only on torchvision"
    ),
}


def is_image_text(config: object) -> bool:
    """Whether the config describes an image-text model (a vision tower beside the decoder)."""
    return getattr(config, "vision_config", None) is not None


def refuse_unserved(config: object, architecture: str) -> None:
    """An image-text family that is not served exactly is refused at start, in one sentence."""
    kind = config.model_type
    if kind in SERVED:
        return
    reason = REFUSED.get(kind, "its image path has not been checked exact against generate here")
    served = ", ".join(sorted(SERVED))
    raise UnsupportedModel(f"{architecture} is not supported: {reason} (image-text families served: {served}).")


class ImageEncoder:
    """The model's vision tower and projector, run on each image once, and the prompt's embeddings
    with the features in place."""

    def __init__(self, model: torch.nn.Module, reference_impl: str) -> None:
        self.model = model
        self.reference_impl = reference_impl  # the tower keeps generate's attention: the paged one is the decoder's
        config = model.config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        wanted = inspect.signature(model.model.get_image_features).parameters
        # M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): image tokens take 3-D rotary positions, by the model's own rule
        self.mrope = hasattr(model.model, "get_rope_index")
        self.opens_images = config.model_type in BOTH_WAYS
        self.deepstack = _DeepStack(model.model.language_model) if _deepstack(config) else None
        self.options = {
            name: getattr(config, name)
            for name in ("vision_feature_layer", "vision_feature_select_strategy", "vision_aspect_ratio")
            if name in wanted and hasattr(config, name)
        }

    def encode(self, images: list[ImageInput]) -> torch.Tensor:
        """``[image tokens, hidden]``: every image's features in prompt order. Images of one shape
        go through the tower together, as ``generate`` runs a prompt's images."""
        inner = self.model.model
        tower = next(getattr(inner, n) for n in ("vision_tower", "vision_model", "visual") if hasattr(inner, n))
        tower.set_attn_implementation(self.reference_impl)
        dtype, device = self.model.dtype, self.model.device
        inputs = [self._tensors(i, device, dtype) for i in images]
        if len({tuple((k, v.shape[1:]) for k, v in sorted(t.items())) for t in inputs}) == 1:
            inputs = [{k: torch.cat([t[k] for t in inputs]) for k in inputs[0]}]  # one call, as generate makes it
            counts = inputs[0].get("batch_num_images")  # LLaVA-OneVision's images per sample (alone: tiled)
            if counts is not None and int(counts.sum()) != len(images):  # each image carried the prompt's count
                inputs[0]["batch_num_images"] = counts[:1]
        parts = []
        for tensors in inputs:  # else each image alone, with its own sizes and masks
            out = self.model.model.get_image_features(**tensors, **self.options)
            # Qwen3-VL's DeepStack: per decoder layer, features added there; kept beside the main ones
            layers = [getattr(out, "pooler_output", out), *(getattr(out, "deepstack_features", None) or [])]
            parts.append(torch.cat([_rows(features) for features in layers], dim=-1))
        return torch.cat(parts).to(dtype)

    @staticmethod
    def _tensors(image: ImageInput, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """An image's processor outputs as the tower's arguments: its pixels and its other outputs."""
        tensors = {"pixel_values": torch.from_numpy(_array(image.pixels, image.shape)).to(device, dtype)}
        for name, values in image.extra.items():
            tensors[name] = torch.from_numpy(_array(values, image.extra_shapes[name], np.int64)).to(device)
        return tensors

    def _encode_reached(self, request: Request, start: int, count: int) -> None:
        """Encode the images this chunk reaches that are not encoded yet (the scheduler keeps them
        within ``--max-encoder-images-per-step``), together where their shapes allow."""
        pending = request.images_to_encode(start, count)
        if not pending:
            return
        features = self.encode([request.images[k] for k in pending])
        sizes = [len(self._image_positions(request, request.images[k])) for k in pending]
        if sum(sizes) != features.shape[0]:
            raise ValueError(f"the vision encoder gave {features.shape[0]} feature rows for {sum(sizes)} image tokens")
        request.image_features.update(zip(pending, features.split(sizes)))

    def _image_positions(self, request: Request, image: ImageInput) -> list[int]:
        """The prompt positions of an image's tokens (its span less any markers around them)."""
        span = request.token_ids[image.offset : image.offset + image.length]
        return [image.offset + j for j, t in enumerate(span) if t == self.image_token_id]

    def both_ways(self, request: Request) -> list[tuple[int, int]]:
        """The prompt ranges ``[start, end)`` whose tokens attend to each other both ways: each run of
        image tokens, for a family that opens its images' attention (none for the others)."""
        if not self.opens_images:
            return []
        return token_runs(request.token_ids[: request.num_prompt_tokens], {self.image_token_id})

    def positions(self, flat: torch.Tensor, rows: list[tuple[Request, int, int, int]]) -> torch.Tensor:
        """``[3, 1, tokens]``: the flat batch's positions on M-RoPE's three axes. A prompt position of
        a request with images takes its 3-D position from ``get_rope_index`` (computed once, at its
        first chunk); a later one continues from the prompt's largest, as ``generate``'s rope delta
        does. Every other row's position is the same on the three axes."""
        out = flat.expand(3, -1, -1).clone()
        for request, first, start, count in rows:
            if request.rope_positions is None:
                request.rope_positions = self._rope_index(request).to(flat.device)
            table = request.rope_positions
            prompt = table.shape[1]
            cached = min(start + count, prompt) - start
            if cached > 0:
                out[:, 0, first : first + cached] = table[:, start : start + cached]
            if start + count > prompt:  # generated tokens: one past the prompt's largest position, then on
                shift = int(table.max()) + 1 - prompt
                low = max(cached, 0)
                out[:, 0, first + low : first + count] += shift
        return out

    def _rope_index(self, request: Request) -> torch.Tensor:
        """The prompt's ``[3, prompt tokens]`` positions, by the model's own ``get_rope_index``."""
        ids = torch.tensor([request.token_ids[: request.num_prompt_tokens]])
        grids = torch.tensor([i.extra["image_grid_thw"] for i in request.images]).reshape(-1, 3)
        types = (ids == self.image_token_id).int()
        positions, _ = self.model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids)
        return positions[:, 0]

    def embeds(self, input_ids: torch.Tensor, rows: list[tuple[Request, int, int, int]]) -> torch.Tensor:
        """The flat batch's input embeddings, with image features at the image-token positions of
        each ``(request, first flat row, first prompt position, count)`` chunk."""
        embeds = self.model.get_input_embeddings()(input_ids)
        hidden = embeds.shape[-1]
        if self.deepstack is not None:
            self.deepstack.pending = None  # never a failed step's
        where: list[int] = []  # flat rows that take image features, in order
        taken: list[torch.Tensor] = []
        for request, first, start, count in rows:
            self._encode_reached(request, start, count)
            for k in request.images_in(start, count):
                image, features = request.images[k], request.image_features[k]
                for p, row in zip(self._image_positions(request, image), features):
                    if start <= p < start + count:
                        embeds[0, first + p - start] = row[:hidden]
                        where.append(first + p - start)
                        taken.append(row[hidden:])
                if image.offset + image.length <= start + count:
                    del request.image_features[k]  # its tokens are in the cache: its features are not needed again
        if self.deepstack is not None and where:
            mask = torch.zeros(input_ids.shape, dtype=torch.bool, device=input_ids.device)
            mask[0, where] = True
            stacked = torch.stack(taken)
            self.deepstack.pending = (mask, list(stacked.split(hidden, dim=-1)))
        return embeds


class _DeepStack:
    """Qwen3-VL adds the tower's intermediate features to the hidden states of its first decoder
    layers at the image tokens' rows (``visual_pos_masks``, ``deepstack_visual_embeds``). Its forward
    makes them only from pixel values; the worker runs on embeddings, so a pre-hook on the
    language model hands over the step's (``pending``: the rows, and the features per layer)."""

    def __init__(self, language_model: torch.nn.Module) -> None:
        self.pending: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        language_model.register_forward_pre_hook(self._hand_over, with_kwargs=True)

    def _hand_over(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.pending is not None and kwargs.get("visual_pos_masks") is None:
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = self.pending
        self.pending = None
        return args, kwargs


def _deepstack(config: object) -> bool:
    return bool(getattr(config.vision_config, "deepstack_visual_indexes", None))


def _rows(features: torch.Tensor | list | tuple) -> torch.Tensor:
    """``[tokens, hidden]`` from a tower output: a tensor, or one per image."""
    if isinstance(features, (list, tuple)):
        features = torch.cat([f.reshape(-1, f.shape[-1]) for f in features])
    return features.reshape(-1, features.shape[-1])


def overlaps_images(request: Request, start: int, count: int) -> bool:
    """Whether prompt positions ``[start, start + count)`` hold any of the request's image tokens."""
    return any(i.offset < start + count and start < i.offset + i.length for i in request.images)


def _array(data: bytes | list[int], shape: list[int], dtype: type = np.float32) -> np.ndarray:
    if isinstance(data, bytes):
        return np.frombuffer(data, dtype="<f4").reshape(shape).copy()
    return np.asarray(data, dtype=dtype).reshape(shape)
