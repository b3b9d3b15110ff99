"""An image-text model's decode rows on the C++ step (worker/models/fused_decode.py): its prompt
chunks keep the torch path (their embeddings carry image features), its decode-only steps take the
step's int8 weights, and the answers stay close to transformers' ``generate`` by vLLM's rule (where
the texts part, each side's token is in the other's top 5); on float32 weights each step it takes
gives the torch path's logits to float32's tolerance, M-RoPE's decode positions (past the images)
included."""

from __future__ import annotations

import io
from dataclasses import replace

import msgspec
import pytest
import torch
from PIL import Image

from bench.accuracy import Generation, check_close
from common.model_source import resolve_model
from tests.vision.models import _loaded, image_bytes, options, render
from tests.vision.test_vision_engine import CONFIG, NEW, NONE, TWO, new_request
from worker import kernels
from worker.build import build_engine
from worker.models.fused_decode import FusedDecode
from worker.selfcheck import EXACT_TOLERANCE, SelfCheck

pytestmark = pytest.mark.skipif(not kernels.load(), reason="the C++ step's kernels do not load here")


@torch.inference_mode()
def reference(folder, messages: list[dict], images: list[bytes]) -> Generation:
    """generate's greedy answer in float32, with each step's top 5."""
    processor, model = _loaded(folder)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(
        text=render(processor, messages),
        images=pil or None,
        add_special_tokens=False,
        return_tensors="pt",
        **options(folder),
    )
    out = model.generate(
        **inputs, max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return Generation(tokens, [], [step[0].topk(5).indices.tolist() for step in out.logits])


# One of each kind (more checked once, not kept: qwen2_5_vl, qwen3_vl, qwen3_vl_moe, idefics3, smolvlm,
# mistral3, pixtral, llava_onevision): a Llama decoder, Gemma 3's, M-RoPE's.
@pytest.mark.parametrize("family", ["llava", "gemma3", "qwen2_vl"])
def test_decode_rows_take_the_int8_step_and_stay_close_to_generate(family, vlm):
    """Two images beside a text request (the start's self-check on, which runs the step's decode
    rows against the eager forward): the decode-only steps run on the C++ step, the prompt's on torch.
    Then the step on float32 weights passes the self-check's exact comparison."""
    folder = vlm(family)
    engine = build_engine(resolve_model(str(folder)), replace(CONFIG, quantization="int8"))
    paths = engine.runner.paths
    assert paths.fused is not None
    calls = {"rows": 0, "flat": 0}
    for name in calls:
        real = getattr(paths, name)
        setattr(
            paths,
            name,
            lambda *a, _real=real, _name=name, **k: calls.__setitem__(_name, calls[_name] + 1) or _real(*a, **k),
        )
    cases = {"two": (TWO, [image_bytes(1), image_bytes(2, (64, 30))]), "none": (NONE, [])}
    want = {name: reference(folder, messages, images) for name, (messages, images) in cases.items()}
    got = serve(engine, folder, cases)
    assert all(check_close(got[name], want[name])[0] for name in cases), (got, want)
    assert calls["rows"] >= NEW - 2 and calls["flat"] >= 1, calls
    # The step on the model's own float32 weights: token for token with the image request (its decode
    # positions: M-RoPE's past the images), and against the eager forward to float32's tolerance (the
    # start-up self-check's exact mode; last: it writes blocks the prefix cache holds). What int8's
    # rounding would hide (a rotary position off by one) fails these.
    runner, rows = engine.runner, calls["rows"]
    runner.quantization, paths.fused = "none", FusedDecode(runner.model, "none")
    errors = against_flat(runner)
    assert serve(engine, folder, {"two": cases["two"]})["two"].tokens == want["two"].tokens
    assert len(errors) >= NEW - 2 and max(errors) < EXACT_TOLERANCE, errors
    SelfCheck(runner.model, runner.layers, runner.max_model_len, runner.block_size).run(runner)
    assert calls["rows"] > rows + NEW - 2, calls


def against_flat(runner) -> list[float]:
    """Each step the C++ step takes is run on the torch path too: the largest logit difference,
    relative to the largest logit, of each (the torch path's M-RoPE positions are generate's)."""
    errors, logits, paths = [], runner.logits, runner.paths

    def both(batch):
        out, requests = logits(batch)
        if paths.takes_rows(batch):
            torch_path = paths.flat(runner.inputs.flat(batch)).float()
            errors.append(float((out.float() - torch_path).abs().max() / torch_path.abs().max()))
        return out, requests

    runner.logits = both
    return errors


def serve(engine, folder, cases: dict[str, tuple[list[dict], list[bytes]]]) -> dict[str, Generation]:
    """Each case's greedy tokens and top 5s, the requests added together."""
    for name, (messages, images) in cases.items():
        request = new_request(folder, name, messages, images)
        engine.add_request(
            msgspec.structs.replace(request, sampling=msgspec.structs.replace(request.sampling, logprobs=5))
        )
    got = {name: Generation([], [], []) for name in cases}
    while engine.has_work():
        for o in engine.step().outputs:
            assert o.error is None, o.error
            got[o.request_id].tokens.extend(o.new_token_ids)
            got[o.request_id].top.extend(lp.top_ids for lp in o.logprobs or [])
    return got


def test_quantized_only_is_refused_for_an_image_text_model(llava):
    """``--quantized-only`` would run prompt chunks (image features in their embeddings) on the step."""
    with pytest.raises(ValueError, match="^--quantized-only .* decode rows only"):
        build_engine(resolve_model(str(llava)), replace(CONFIG, quantization="int8", quantized_only=True))
