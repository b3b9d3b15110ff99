"""An image-text model's decode rows on the C++ step (worker/models/fused_decode.py): its prompt
chunks keep the torch path (their embeddings carry image features), its decode-only steps take the
step's int8 weights, and the answers stay close to transformers' ``generate`` by vLLM's rule (where
the texts part, each side's token is in the other's top 5). Families the step cannot follow (M-RoPE's
shifted decode positions) keep the torch path, refused by ``supports`` with the reason."""

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
from worker.models.fused_decode import FusedDecode, supports
from worker.selfcheck import SelfCheck

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


@pytest.mark.parametrize("family", ["llava", "gemma3"])
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
    for name, (messages, images) in cases.items():
        assert check_close(got[name], reference(folder, messages, images))[0], name
    assert calls["rows"] >= NEW - 2 and calls["flat"] >= 1, calls
    # The step on the model's own float32 weights, against the eager forward to float32's tolerance
    # (the start-up self-check's exact mode): what int8's rounding would hide (a rotary position off by one).
    runner, rows = engine.runner, calls["rows"]
    runner.quantization, paths.fused = "none", FusedDecode(runner.model, "none")
    SelfCheck(runner.model, runner.layers, runner.max_model_len, runner.block_size).run(runner)
    assert calls["rows"] > rows


def test_m_rope_families_keep_the_torch_path(vlm):
    _, model = _loaded(vlm("qwen2_vl"))
    assert "M-RoPE" in supports(model)
