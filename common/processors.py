"""An image-text model's processor from its files, on the PIL image processors.

PyPI's torchvision is built for the CUDA torch and fails to import beside the CPU one, so every
processor here is built on its family's PIL image processor (``backend="pil"``). Two kinds of class
do not construct that way as they are, and get their own road:

- those with a video processor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, SmolVLM, LLaVA-OneVision), which
  needs torchvision: the class less its video half (``image_half``);
- ``PixtralProcessor`` (Mistral 3, Pixtral), which transformers marks as needing torchvision, so
  ``transformers.PixtralProcessor`` is a placeholder that raises; its module also imports one
  size helper from the torchvision image processor's module. Its PIL image processor's module
  has the same helper, so the real class is imported with that module standing in (``pixtral_class``).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import sys
import threading
import types
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_IMPORT = threading.Lock()


def load_processor(folder: str, tokenizer: Any, options: dict[str, Any] | None = None) -> Any:
    """The model's processor (the saved one), on PIL, with ``options`` (``--mm-processor-kwargs``)
    as its image options, over its class's defaults (as if each call passed them)."""
    processor = _saved_processor(folder, tokenizer)
    if options:
        processor.images_kwargs = {**getattr(processor, "images_kwargs", {}), **options}
    return processor


def _saved_processor(folder: str, tokenizer: Any) -> Any:
    """Its own class, else its image half, else the torchvision-marked class it names imported for real."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(folder, backend="pil")
    except Exception as exc:  # a processor that needs torchvision for a part of it
        saved = Path(folder, "processor_config.json")
        name = json.loads(saved.read_text()).get("processor_class") if saved.is_file() else None
        if name == "PixtralProcessor":
            return pixtral_class().from_pretrained(folder, backend="pil")
        log.debug("%s does not construct on PIL (%s): its image half alone", name, exc)
        return image_half(folder, tokenizer)


def image_half(folder: str, tokenizer: Any) -> Any:
    """The model's own processor class without its video processor, which needs torchvision here
    (Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's, SmolVLM's): the image processor on PIL and the class's own
    placeholder rule. The gateway renders templates itself, so the processor's is not needed."""
    import transformers

    config = json.loads(Path(folder, "processor_config.json").read_text())
    base = getattr(transformers, config["processor_class"])
    if "video_processor" not in base.get_attributes():
        raise ValueError(f"{base.__name__} did not fail for its video processor")
    images_only = type(
        base.__name__, (base,), {"get_attributes": classmethod(lambda cls: ["image_processor", "tokenizer"])}
    )
    images = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")
    skip = ("processor_class", "image_processor", "video_processor", "chat_template", "auto_map")
    options = {k: v for k, v in config.items() if k not in skip}  # SmolVLM's image_seq_len...
    return images_only(image_processor=images, tokenizer=tokenizer, video_processor=None, **options)


@functools.cache
def pixtral_class() -> type:
    """transformers' own ``PixtralProcessor``: its module imported with the PIL image processor's
    module in place of the torchvision one for its one import from it (``get_resize_output_image_size``,
    the same function in both); the stand-in is gone once the import is done."""
    import transformers.processing_utils  # noqa: F401  (loaded first: the stand-in must serve only this import)
    from transformers.models.pixtral import image_processing_pil_pixtral as pil

    torchvision_module = "transformers.models.pixtral.image_processing_pixtral"
    stand_in = types.ModuleType(torchvision_module)
    stand_in.get_resize_output_image_size = pil.get_resize_output_image_size
    with _IMPORT:
        present = sys.modules.get(torchvision_module)
        sys.modules[torchvision_module] = present or stand_in
        try:
            module = importlib.import_module("transformers.models.pixtral.processing_pixtral")
        finally:
            if present is None:
                del sys.modules[torchvision_module]
    return module.PixtralProcessor
