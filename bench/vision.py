"""``python -m bench.vision [--shape tiny|1b] [--levels 1,8] [--images 1]``: time to first token and
inter-token latency of chat requests with an image (one image + about 64 text tokens in, 64 out)
beside the same text without the image, at each concurrency level, on one fresh ``llmpool serve``
of a random-weight LLaVA (transformers' own config classes, the default model's tokenizer).

- ``tiny``: the tests' shapes (a Llama decoder of hidden 64, 2 layers; a CLIP tower of hidden 32,
  2 layers, 32-pixel images in 16 tokens).
- ``1b``: Llama-3.2-1B's decoder shape (bench/random_llama.py) and a ViT-B/16 CLIP tower (hidden
  768, 12 layers, 224-pixel images in 196 tokens), saved in bfloat16: 1.2 B parameters.

Each level first sends one request of each kind (not counted), then ``--requests`` requests per level
of text alone and then with images. The figures go in docs/vision.md ("Speed").
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shlex
import tempfile
from pathlib import Path

import orjson

from bench.load import run_bodies
from bench.prompts import PROMPTS
from bench.random_llama import SHAPES, load_default_tokenizer
from bench.servers import served_name, start_llmpool, stop
from bench.stats import summarize
from tests.vision.models import LLAVA_TEMPLATE, image_bytes

TEXT_TOKENS = 64
TOWERS = {
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8),
    "1b": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224, patch_size=16),
}  # fmt: skip
DECODERS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "1b": dict(SHAPES["1b"], head_dim=64, tie_word_embeddings=True),
}  # fmt: skip


def build(folder: Path, shape: str, seed: int = 0) -> Path:
    """A random LLaVA of ``shape`` with its processor and chat template, saved to ``folder``."""
    import torch
    import transformers

    tokenizer = load_default_tokenizer(None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    text = transformers.LlamaConfig(
        vocab_size=len(tokenizer), pad_token_id=ids["eos_token_id"], **ids, **DECODERS[shape]
    )
    vision = transformers.CLIPVisionConfig(**TOWERS[shape])
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=tokenizer.convert_tokens_to_ids("<image>")
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    torch.manual_seed(seed)
    dtype = torch.float32 if shape == "tiny" else torch.bfloat16
    model = transformers.LlavaForConditionalGeneration(config).to(dtype).eval()
    side = vision.image_size
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
    processor = transformers.LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=vision.patch_size,
        vision_feature_select_strategy="default", chat_template=LLAVA_TEMPLATE, num_additional_image_tokens=1,
    )  # fmt: skip
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def prompt_text() -> str:
    """About ``TEXT_TOKENS`` tokens of the fixed prompts, cut at a word."""
    tokenizer = load_default_tokenizer(None)
    ids = tokenizer.encode(" ".join(PROMPTS), add_special_tokens=False)[:TEXT_TOKENS]
    return tokenizer.decode(ids).rsplit(" ", 1)[0]


def body(model: str, text: str, images: int, max_tokens: int) -> bytes:
    """A streamed chat request: ``images`` data-URI images (seeded, 64x48 PNG) then the text."""
    parts = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(image_bytes(i, (64, 48))).decode()}}
        for i in range(images)
    ]  # fmt: skip
    message = {"role": "user", "content": [*parts, {"type": "text", "text": text}]}
    return orjson.dumps(
        {"model": model, "messages": [message], "max_tokens": max_tokens, "stream": True,
         "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0}
    )  # fmt: skip


def measure(url: str, model: str, levels: list[int], images: int, requests: int, out: int) -> list[dict]:
    """Per level, text alone then text with images: vLLM's summary of each (bench/stats.py)."""
    text = prompt_text()
    kinds = {"text": body(model, text, 0, out), f"{images} image": body(model, text, images, out)}
    rows = []
    for level in levels:
        for kind, payload in kinds.items():
            asyncio.run(run_bodies(url, [payload], 1, 1))  # warm: first-use costs out of the figures
            timings, wall = asyncio.run(run_bodies(url, [payload], level, requests or 2 * level))
            rows.append({"kind": kind} | summarize(level, timings, wall))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(TOWERS), default="tiny")
    parser.add_argument("--levels", default="1,8", help="concurrent streams, comma-separated")
    parser.add_argument("--images", type=int, default=1, help="images in each image request")
    parser.add_argument("--requests", type=int, default=0, help="requests per level and kind (0: twice the level)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-arg", default="", help="more `llmpool serve` flags")
    parser.add_argument("--folder", type=Path, help="where the model is (built there when absent)")
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix=f"vlm-{args.shape}-"))
    if not (folder / "config.json").is_file():
        build(folder, args.shape)
    processes, url = start_llmpool(1, ["--model", str(folder), *shlex.split(args.server_arg)], False)
    try:
        levels = [int(n) for n in args.levels.split(",")]
        rows = measure(url, served_name(str(folder)), levels, args.images, args.requests, args.max_tokens)
    finally:
        stop(processes)
    print(f"{'kind':>9} {'streams':>7} {'prompt':>6} {'TTFT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'errors':>6}")
    for r in rows:
        prompt = r["total_input_tokens"] // max(r["completed"], 1)
        print(
            f"{r['kind']:>9} {r['concurrency']:>7} {prompt:>6} {r['median_ttft_ms']:>9.1f} "
            f"{r['median_itl_ms']:>8.1f} {r['p99_itl_ms']:>8.1f} {r['errors']:>6}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
