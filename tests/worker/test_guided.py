"""Guided decoding in the engine with the real model and tokenizer: the output follows the grammar,
guided and free requests share a step, a free row's logits are untouched, and a resumed request's
grammar picks up where the dead worker left it."""

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from common.config import CACHE_DIR
from common.model_source import load_tokenizer, resolve_model
from common.protocol import Guide, GuideKind, NewRequest, Reasoning, SamplingParams
from common.reasoning import ThinkState
from tests.worker.test_engine import PROMPTS
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    return build_engine(resolve_model("SmolLM2-135M-Instruct"), WorkerConfig(dtype="float32", kv_cache_memory="64MiB"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), CACHE_DIR.env_default())


def drain(engine: Engine) -> tuple[dict[str, list[int]], dict[str, str], list[int]]:
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    batch_sizes = []
    while engine.has_work():
        step = engine.step()
        batch_sizes.append(step.batch_size)
        for out in step.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.error:
                errors[out.request_id] = out.error
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return tokens, errors, batch_sizes


def test_guided_and_free_requests_share_steps_and_the_free_one_is_unchanged(engine, tokenizer):
    engine.add_request(NewRequest("free-alone", PROMPTS[0], 24, SamplingParams(temperature=0)))
    alone, _, _ = drain(engine)
    engine.add_request(NewRequest("free", PROMPTS[0], 24, SamplingParams(temperature=0)))
    engine.add_request(
        NewRequest(
            "json",
            PROMPTS[1],
            60,
            SamplingParams(temperature=0),
            guide=Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        )
    )
    engine.add_request(
        NewRequest("obj", PROMPTS[2], 60, SamplingParams(temperature=0.9, seed=3), guide=Guide(GuideKind.JSON_OBJECT))
    )
    tokens, errors, sizes = drain(engine)
    assert not errors and max(sizes) == 3
    assert tokens["free"] == alone["free-alone"]
    document = json.loads(tokenizer.decode(tokens["json"], skip_special_tokens=True))
    jsonschema.validate(document, SCHEMA)
    assert isinstance(json.loads(tokenizer.decode(tokens["obj"], skip_special_tokens=True)), dict)
    assert tokens["json"][-1] in engine.runner.eos_token_ids  # a finished grammar ends the request


def test_mask_touches_only_guided_rows(engine):
    from worker.request import Request

    guided = Request.from_wire(
        NewRequest("g", [1, 2], 5, guide=Guide(GuideKind.JSON_OBJECT)), engine.runner.eos_token_ids
    )
    free = Request.from_wire(NewRequest("f", [1, 2], 5), engine.runner.eos_token_ids)
    engine.runner.guided.add(guided)
    try:
        logits = torch.randn(2, engine.runner.vocab_size)
        masked = engine.runner.guided.mask(logits, [free, guided])
        assert torch.equal(masked[0], logits[0])
        allowed = torch.isfinite(masked[1])
        assert 0 < allowed.sum() < 200  # a JSON object starts with "{" (and a few tokens that begin with it)
    finally:
        engine.runner.guided.remove("g")


def test_a_resumed_request_continues_its_grammar(engine, tokenizer):
    engine.add_request(
        NewRequest(
            "whole",
            PROMPTS[1],
            60,
            SamplingParams(temperature=0),
            guide=Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)),
        )
    )
    whole = drain(engine)[0]["whole"]
    cut = 5  # a worker died after five tokens: the new one gets them as prompt, marked as generated
    engine.add_request(
        NewRequest(
            "rest",
            PROMPTS[1] + whole[:cut],
            60 - cut,
            SamplingParams(temperature=0),
            guide=Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA)),
            resumed_tokens=cut,
        )
    )
    assert whole[:cut] + drain(engine)[0]["rest"] == whole


def test_an_invalid_grammar_is_an_error_for_that_request_only(engine):
    engine.add_request(NewRequest("bad", PROMPTS[0], 8, guide=Guide(GuideKind.JSON_SCHEMA, '{"type": "no-such-type"}')))
    engine.add_request(NewRequest("good", PROMPTS[0], 8, SamplingParams(temperature=0)))
    tokens, errors, _ = drain(engine)
    assert "bad" in errors and "grammar" in errors["bad"]
    assert len(tokens["good"]) == 8


def thinking_markers(tokenizer) -> tuple[list[int], list[int]]:
    """``<thinking>`` and ``</thinking>``, three tokens each in SmolLM2's vocabulary (the worker
    only sees ids: a marker of several tokens is matched, and forced, token by token)."""
    start, end = (tokenizer.encode(marker, add_special_tokens=False) for marker in ("<thinking>", "</thinking>"))
    assert len(start) == len(end) == 3
    return start, end


def test_a_thinking_budget_forces_the_end_marker_then_the_grammar_applies(engine, tokenizer):
    """Thinking is free sampling (the grammar would forbid its first token); the budget ends it
    with the end marker's tokens; the answer after it follows the grammar to its end."""
    start, end = thinking_markers(tokenizer)
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    engine.add_request(NewRequest("free", PROMPTS[1], 4, SamplingParams(temperature=0)))
    engine.add_request(
        NewRequest(
            "think",
            PROMPTS[1],
            80,
            SamplingParams(temperature=0),
            guide=guide,
            reasoning=Reasoning(start, end, ThinkState.THINKING, 4),
        )
    )
    # The model may open its thinking despite the grammar: a bias makes it take the start marker's
    # first token, and once begun the marker is finished (the grammar never saw those tokens).
    opened = SamplingParams(temperature=0, logit_bias={start[0]: 100.0})
    engine.add_request(
        NewRequest("open", PROMPTS[2], 80, opened, guide=guide, reasoning=Reasoning(start, end, ThinkState.PENDING, 3))
    )
    tokens, errors, _ = drain(engine)
    assert not errors
    think, free = tokens["think"], tokens["free"]
    assert think[:4] == free and not tokenizer.decode(free[:1]).lstrip().startswith("{")  # the grammar would forbid
    assert think[4:7] == end
    jsonschema.validate(json.loads(tokenizer.decode(think[7:], skip_special_tokens=True)), SCHEMA)
    opened_tokens = tokens["open"]
    assert opened_tokens[:6] == start + [start[0]] * 3 and opened_tokens[6:9] == end  # 3 thinking tokens, the end
    jsonschema.validate(json.loads(tokenizer.decode(opened_tokens[9:], skip_special_tokens=True)), SCHEMA)


def test_a_resumed_request_keeps_its_thinking_budget(engine, tokenizer):
    """Resumed inside the thinking, or halfway through the forced end marker, the rest comes out the same."""
    start, end = thinking_markers(tokenizer)
    spec = Reasoning(start, end, ThinkState.THINKING, 3)
    engine.add_request(NewRequest("whole", PROMPTS[0], 7, SamplingParams(temperature=0), reasoning=spec))
    whole = drain(engine)[0]["whole"]
    assert whole[3:6] == end and end[0] not in whole[:3]
    for done in (2, 4):  # a worker died after two thinking tokens, or after the marker's first token
        engine.add_request(
            NewRequest(
                f"rest{done}",
                PROMPTS[0] + whole[:done],
                7 - done,
                SamplingParams(temperature=0),
                resumed_tokens=done,
                reasoning=spec,
            )
        )
        assert whole[:done] + drain(engine)[0][f"rest{done}"] == whole


GUIDED_STEP_IMPORTS = """
import sys
from types import SimpleNamespace
import torch
from common.config import CACHE_DIR
from common.model_source import load_tokenizer, resolve_model
from common.protocol import Guide, GuideKind
from worker.guided import GuidedDecoding

guided = GuidedDecoding(lambda: load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), CACHE_DIR.env_default()), 49152, frozenset([2]))
request = SimpleNamespace(request_id="r", guide=Guide(GuideKind.JSON_OBJECT), generated_token_ids=[], reasoning=None)
guided.add(request)
masked = guided.mask(torch.zeros(1, 49152), [request])
print(int(torch.isinf(masked).sum()), "torch._dynamo" in sys.modules)
"""


def test_the_first_guided_step_imports_no_compiler():
    """llguidance.torch imports torch's compiler (3.4 s on the test machine): inside the first guided
    step it stalled every request of the batch. The mask is filled through llguidance.numpy."""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", GUIDED_STEP_IMPORTS], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    masked, dynamo = out.stdout.split()
    assert int(masked) > 0, "the mask should forbid tokens"
    assert dynamo == "False", "the guided step imported torch._dynamo"
