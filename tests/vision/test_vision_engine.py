"""An image-text model in the worker's engine, token for token against transformers' ``generate`` in
float32: one image, two images and none, batched together; and the prefix cache keyed by pixels."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import msgspec
import pytest
from PIL import Image

from common.model_source import bundle_tokenizer, resolve_model, unpack_bundle
from common.protocol import NewRequest, SamplingParams
from gateway.generate.vision import Vision
from tests.vision.models import image_bytes, options, reference, render
from tests.vision.models import processor as model_processor
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.models.support import UnsupportedModel
from worker.models.vision import SERVED, refuse_unserved

NEW = 8
ONE = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
TWO = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}]},
    {"role": "assistant", "content": "a picture"},
    {"role": "user", "content": [{"type": "text", "text": "this one?"}, {"type": "image"}]},
]
NONE = [{"role": "user", "content": "Hello there"}]


CONFIG = WorkerConfig(dtype="float32", kv_cache_memory="16MiB")
QUICK = replace(CONFIG, skip_self_check=True)


@pytest.fixture(scope="module")
def engine(llava):
    return build_engine(resolve_model(str(llava)), CONFIG)


@functools.cache
def gateway_processor(folder: Path) -> object:
    """The processor as a gateway gets it: out of the worker's tokenizer bundle."""
    tokenizer = model_processor(folder).tokenizer
    kwargs = json.dumps(options(folder)) if options(folder) else None  # --mm-processor-kwargs
    bundle = bundle_tokenizer(tokenizer, tokenizer.chat_template or "", resolve_model(str(folder)), kwargs)
    processor = unpack_bundle(bundle.packed)[1]
    assert processor is not None
    return processor


def new_request(folder: Path, rid: str, messages: list[dict], images: list[bytes]) -> NewRequest:
    """The gateway's way: the template rendered, tokenized, each image token expanded by the processor."""
    processor = gateway_processor(folder)
    text = render(model_processor(folder), messages)
    ids = processor.tokenizer.encode(text, add_special_tokens=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    ids, inputs = Vision(processor).expand(ids, pil)
    return NewRequest(rid, ids, NEW, SamplingParams(temperature=0), ignore_eos=True, images=inputs)


def run(engine, requests: list[NewRequest], ahead: int = 0) -> dict[str, tuple[list[int], int]]:
    """Each request's tokens and cached prompt tokens, all admitted together, but the first ``ahead``
    one step earlier (decoding when the others come, so these get one image encoded a step)."""
    for r in requests[:ahead] or requests:
        engine.add_request(r)
    out: dict[str, tuple[list[int], int]] = {r.request_id: ([], 0) for r in requests}
    for step in range(100 * len(requests)):  # a step that fails its requests ends them without NEW tokens
        for r in requests[ahead:] if step == 1 and ahead else []:
            engine.add_request(r)
        if all(len(out[r.request_id][0]) >= NEW for r in requests):
            break
        for o in engine.step().outputs:
            assert not o.error, o.error
            tokens, cached = out[o.request_id]
            out[o.request_id] = (tokens + o.new_token_ids, max(cached, o.num_cached_tokens))
    return out


@pytest.mark.parametrize("family", [*sorted(SERVED), "pixtral"])  # Pixtral: LLaVA's class, its own tower
def test_images_match_generate_alone_and_batched_with_text(engine, family, vlm):
    """Two images of different sizes in two messages (text between and after them: M-RoPE's
    positions past each image) beside a text-only request that decodes meanwhile (so one image is
    encoded a step, the CPU's ``--max-encoder-images-per-step``), then alone (both in one step).
    One image against generate: the prefix-cache test."""
    folder = vlm(family)
    # the others without the start's self-check (text positions against the eager forward; LLaVA's runs it)
    served = engine if family == "llava" else build_engine(resolve_model(str(folder)), QUICK)
    cases = {"two": (TWO, [image_bytes(1), image_bytes(2, (64, 30))]), "none": (NONE, [])}
    if family == "llava_onevision":  # a lone image is tiled (anyres), each of several is not
        cases["one"] = (ONE, [image_bytes(3, (64, 30))])
    want = {name: reference(folder, m, imgs, NEW) for name, (m, imgs) in cases.items()}
    ordered = sorted(cases.items(), key=lambda case: case[0] != "none")  # the text request decoding first
    with encoded(served) as calls:
        batched = run(served, [new_request(folder, name, m, imgs) for name, (m, imgs) in ordered], ahead=1)
    assert {name: got[0] for name, got in batched.items()} == want
    assert set(calls.values()) == {1}, calls  # one image a step
    alone = run(served, [new_request(folder, "alone", *cases["two"])])  # its blocks from the prefix cache
    assert alone["alone"][0] == want["two"]
    if family in (
        "qwen2_vl",
        "gemma3",
    ):  # M-RoPE positions (the same code for every Qwen) with prefill chunks cutting images
        chunked = build_engine(
            resolve_model(str(folder)), replace(QUICK, max_num_batched_tokens=8, max_prefill_chunk=8)
        )
        assert run(chunked, [new_request(folder, "chunked", *cases["two"])])["chunked"][0] == want["two"]


def test_the_prefix_cache_shares_an_image_only_with_itself(engine, llava):
    """Same image and text: the blocks are shared; another image (same placeholders): none are,
    and the answer is that image's own."""
    first = run(engine, [new_request(llava, "p1", ONE, [image_bytes(7)])])["p1"]
    again = run(engine, [new_request(llava, "p2", ONE, [image_bytes(7)])])["p2"]
    other = run(engine, [new_request(llava, "p3", ONE, [image_bytes(8)])])["p3"]
    assert again == (first[0], again[1]) and again[1] >= 16  # the image's 16 tokens came from the cache
    assert other[1] < 16 and other[0] == reference(llava, ONE, [image_bytes(8)], NEW) != first[0]


@contextlib.contextmanager
def encoded(engine) -> Iterator[dict[int, int]]:
    """Counts the images the engine's vision encoder runs on, by step."""
    calls: dict[int, int] = {}
    encode = engine.runner.vision.encode

    def counted(images):
        calls[engine.num_steps] = calls.get(engine.num_steps, 0) + len(images)
        return encode(images)

    engine.runner.vision.encode = counted
    try:
        yield calls
    finally:
        engine.runner.vision.encode = encode


FOUR = [{"role": "user", "content": [*[{"type": "image"}] * 4, {"type": "text", "text": "Which differ?"}]}]


def test_many_images_are_encoded_over_steps_while_another_request_decodes(engine, llava):
    """One image a step (the CPU's ``--max-encoder-images-per-step``): a request with 4 images,
    admitted while a text request decodes, has them encoded in 4 steps, in each of which the text
    request gets its token; and its answer is still generate's."""
    talker = msgspec.structs.replace(new_request(llava, "talker", NONE, []), max_new_tokens=40)
    images = [image_bytes(20 + i) for i in range(4)]
    engine.add_request(talker)
    while not any(o.new_token_ids for o in engine.step().outputs):
        pass
    with encoded(engine) as calls:
        engine.add_request(new_request(llava, "looker", FOUR, images))
        got: dict[str, list[int]] = {"talker": [], "looker": []}
        stepped = []  # for each step that encoded images: whether the talker got a token in it
        while len(got["looker"]) < NEW:
            step = engine.num_steps
            outputs = {o.request_id: o.new_token_ids for o in engine.step().outputs}
            for rid, tokens in outputs.items():
                got[rid] += tokens
            if step in calls:
                stepped.append(bool(outputs.get("talker")))
    engine.abort(["talker"])
    assert sorted(calls.values()) == [1, 1, 1, 1] and stepped == [True] * 4, (calls, stepped)
    assert got["looker"] == reference(llava, FOUR, images, NEW)


@pytest.mark.parametrize("kind", ["mllama", "llama4"])
def test_unserved_families_are_refused_by_name(kind):
    class Config:
        model_type = kind

    with pytest.raises(UnsupportedModel, match=f"{kind}.*not supported: its"):
        refuse_unserved(Config(), f"X (model type {kind!r})")


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ("[1]", "a JSON object, not list"),
        ("{x", "a JSON object: "),
        ('{"do_pan_and_scan": true}', "has no processor files"),
    ],
)
def test_mm_processor_kwargs_are_a_json_object_for_an_image_text_model(tokenizer, kwargs, why):
    """``--mm-processor-kwargs``: refused at start (the worker's bundle) unless a JSON object for a model with a processor."""
    with pytest.raises(ValueError, match=f"^--mm-processor-kwargs .*{re.escape(why)}"):
        bundle_tokenizer(tokenizer, "", None, kwargs)


def test_the_kv_store_keys_image_blocks_by_pixels(llava, tmp_path):
    """Two workers on one store: the second, asked about another image with the same tokens, reads
    nothing and answers for its own image (its prefill in chunks of 8 tokens, which cut through the
    image); asked about the first worker's image, it reads the image's blocks and gives its answer."""
    config = replace(QUICK, kv_store=str(tmp_path))
    first = build_engine(resolve_model(str(llava)), config)
    stored = run(first, [new_request(llava, "s1", ONE, [image_bytes(7)])])["s1"]
    first.kv_store.flush()
    second = build_engine(resolve_model(str(llava)), replace(config, max_num_batched_tokens=8, max_prefill_chunk=8))
    got = run(second, [new_request(llava, "s2", ONE, [image_bytes(8)])])["s2"]
    assert got == (reference(llava, ONE, [image_bytes(8)], NEW), 0)
    again = run(second, [new_request(llava, "s3", ONE, [image_bytes(7)])])["s3"]
    assert again[0] == stored[0] and again[1] >= 16 and second.kv_store.counters.hits > 0


def test_an_image_text_gguf_is_refused_in_one_sentence(tmp_path):
    """llama.cpp's projector file, or a language model file with one beside it: refused by name,
    never loaded as a text-only causal LM."""
    import gguf
    import numpy as np
    import torch

    from worker.loader import load_model

    def write(name: str, architecture: str) -> str:
        writer = gguf.GGUFWriter(str(tmp_path / name), architecture)
        writer.add_tensor("weight", np.zeros(4, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return str(tmp_path / name)

    projector = write("mmproj-tiny-f16.gguf", "clip")
    text = write("tiny-vlm-q4.gguf", "llama")
    for path, why in ((projector, "is a vision projector"), (text, "comes with the vision projector mmproj-tiny")):
        with pytest.raises(UnsupportedModel, match=f"^an image-text GGUF model is not supported: .*{why}.*; serve"):
            load_model(resolve_model(path), torch.float32, str(tmp_path / "cache"))
