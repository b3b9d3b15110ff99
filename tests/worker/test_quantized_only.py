"""``--quantized-only``: every batch, prompts included, runs the C++ step on its quantized weights, and
the model's float copy is freed (the default for a GGUF on the CPU). Answers must stay close to those
with prompts on the torch path (``--no-quantized-only``):
vLLM's closeness rule on greedy answers, and prompt logprobs within quantization noise."""

from __future__ import annotations

import re

import pytest

from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from tests.worker.factories import drain, tokens
from tests.worker.test_engine import PROMPTS
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine

MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 16


def engine_for(**settings: object) -> Engine:
    return build_engine(resolve_model(MODEL), WorkerConfig(kv_cache_memory="64MiB", **settings))


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    only = engine_for(quantized_only=True)
    if not only.runner.paths.rows_only:  # pragma: no cover - built only where it can run
        pytest.skip("needs the C++ kernels with packed weights")
    return engine_for(quantized_only=False), only  # prompts on the torch path, as for a model not a GGUF


def answers(engine: Engine) -> dict[str, list]:
    news = [
        NewRequest(f"r{i}", ids, NEW_TOKENS, SamplingParams(temperature=0, logprobs=5), ignore_eos=True)
        for i, ids in enumerate(PROMPTS)
    ]
    return drain(engine, news)


def test_refused_where_the_step_cannot_take_prompts():
    with pytest.raises(ValueError, match=re.escape("--quantized-only runs every batch through the C++ step")):
        engine_for(dtype="float32", quantization="none", quantized_only=True, skip_self_check=True)


def test_it_is_the_default_for_a_gguf_on_the_cpu_in_float32():
    """No flags: the default model (a Q4_1 GGUF) runs every batch through the C++ step in float32,
    its float copy and native forward kept (runtime adapters are applied through it); --no-quantized-only
    keeps prompts on the torch path."""
    default = engine_for(skip_self_check=True)
    assert default.runner.paths.rows_only and str(default.runner.dtype) == "torch.float32"
    assert default.runner.native is not None
    default.runner.drop_float_weights()
    assert sum(p.numel() for p in default.runner.model.parameters()) > 0
    off = engine_for(quantized_only=False, skip_self_check=True)
    assert not off.runner.paths.rows_only and off.runner.native is not None


def test_the_float_weights_are_freed(engines):
    """No float copy of a layer is left: not in the model, and no native forward holding its own."""
    _, only = engines
    assert sum(p.numel() for p in only.runner.model.model.layers.parameters()) == 0
    assert only.runner.native is None


def test_greedy_answers_are_close_to_the_default_modes(engines):
    """Where the answers part, each side's token is in the other's top 5 at that position (vLLM's
    check_logprobs_close); after that the texts may differ."""
    default, only = (answers(engine) for engine in engines)
    assert default.keys() == only.keys() == {f"r{i}" for i in range(len(PROMPTS))}
    agreed = 0
    for rid in default:
        want, got = tokens(default[rid]), tokens(only[rid])
        assert len(got) == NEW_TOKENS
        want_lp = [lp for o in default[rid] for lp in o.logprobs]
        got_lp = [lp for o in only[rid] for lp in o.logprobs]
        for position, (a, b) in enumerate(zip(want, got)):
            if a != b:
                assert a in got_lp[position].top_ids and b in want_lp[position].top_ids, (rid, position)
                break
            agreed += 1
    assert agreed >= NEW_TOKENS  # at least one answer's worth of tokens agree: not an unrelated model


def test_prompt_logprobs_come_from_the_quantized_step(engines):
    default, only = engines
    prompt = PROMPTS[1]
    entries = {}
    for name, engine in (("default", default), ("only", only)):
        engine.add_request(NewRequest("p", prompt, 2, SamplingParams(temperature=0, prompt_logprobs=3)))
        (sent,) = [o.prompt_logprobs for o in drain(engine)["p"] if o.prompt_logprobs is not None]
        entries[name] = sent
    assert len(entries["only"]) == len(prompt) - 1
    for want, got in zip(entries["default"], entries["only"]):
        assert abs(want.logprob - got.logprob) < 0.5  # q4 weights with int8 activations against bf16
        assert want.top_ids[0] in got.top_ids
