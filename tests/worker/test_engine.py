"""The engine in-process with the real default model: batching, chunked prefill and preemption must
not change greedy output. In float32 both model implementations (the native Llama forward and
transformers' classes) match transformers' ``generate`` exactly."""

import pytest
import torch

from common.config import CACHE_DIR
from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.loader import load_model

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 31530, 253, 1403, 21881, 563, 260, 5304, 30, 2, 198, 1, 520, 9531, 198],
]
NEW_TOKENS = 20


def run(engine: Engine, prompts: list[list[int]]) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(NewRequest(f"r{i}", ids, NEW_TOKENS, SamplingParams(temperature=0)))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    return out


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    model = load_model(resolve_model("SmolLM2-135M-Instruct"), torch.float32, CACHE_DIR.env_default()).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist() for p in PROMPTS]


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize(
    "settings",
    [
        {"max_num_batched_tokens": 512, "kv_cache_memory": "64MiB"},  # plain batching
        {"max_num_batched_tokens": 7, "kv_cache_memory": "64MiB"},  # prompts prefilled in chunks of <= 7 tokens
        {"max_num_batched_tokens": 512, "kv_cache_memory": "2MiB", "block_size": 4},  # so few blocks that requests get preempted
    ],
    ids=["batched", "chunked-prefill", "preemption"],
)
def test_greedy_output_matches_generate_in_float32(settings, impl, reference):
    config = WorkerConfig(dtype="float32", model_impl=impl, **settings)
    engine = Engine(resolve_model("SmolLM2-135M-Instruct"), config)
    out = run(engine, PROMPTS)
    assert [out[f"r{i}"] for i in range(len(PROMPTS))] == reference
    if "block_size" in settings:
        assert engine.scheduler.num_preemptions > 0


def test_a_request_that_can_never_fit_is_rejected_not_stuck():
    engine = Engine(resolve_model("SmolLM2-135M-Instruct"), WorkerConfig(kv_cache_memory="2MiB", block_size=4))
    engine.add_request(NewRequest("big", list(range(1, 400)), 100, SamplingParams(temperature=0)))
    outputs = engine.step().outputs
    assert outputs[0].finish_reason == "error" and "KV cache" in outputs[0].error
    assert not engine.has_work()


def test_a_prefix_cache_hit_gives_the_same_answer_as_a_cold_run():
    engine = Engine(resolve_model("SmolLM2-135M-Instruct"), WorkerConfig(dtype="float32", kv_cache_memory="64MiB"))
    prompt = PROMPTS[2] + PROMPTS[1] + PROMPTS[2]  # 50 tokens: 3 full blocks of 16 can be reused
    cold = run(engine, [prompt])["r0"]
    assert engine.blocks.hit_tokens == 0
    engine.add_request(NewRequest("warm", prompt, NEW_TOKENS, SamplingParams(temperature=0)))
    warm, outputs = [], []
    while engine.has_work():
        outputs += engine.step().outputs
    warm = [t for o in outputs for t in o.new_token_ids]
    assert warm == cold
    assert outputs[0].num_cached_tokens == 48 and engine.blocks.hit_tokens == 48


@pytest.mark.parametrize("budget", [512, 7], ids=["whole-prompt", "chunked-prefill"])
def test_prompt_logprobs_match_a_full_forward(budget):
    """echo + logprobs: every prompt token after the first gets its logprob (and the top k), the
    same whether the prompt is computed at once or in chunks, and a warm prefix cache is bypassed."""
    source = resolve_model("SmolLM2-135M-Instruct")
    engine = Engine(source, WorkerConfig(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=budget))
    prompt = PROMPTS[1]
    engine.add_request(NewRequest("warm", prompt, 2, SamplingParams(temperature=0)))  # fills the prefix cache
    engine.add_request(NewRequest("p", prompt, 2, SamplingParams(temperature=0, prompt_logprobs=2)))
    sent = []
    while engine.has_work():
        sent += [o.prompt_logprobs for o in engine.step().outputs if o.request_id == "p" and o.prompt_logprobs is not None]
    (entries,) = sent  # once, with the first token
    model = load_model(source, torch.float32, CACHE_DIR.env_default()).eval()
    with torch.inference_mode():
        reference = model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries):
        assert abs(entry.logprob - reference[position, prompt[position + 1]].item()) < 1e-3
        assert entry.top_ids == reference[position].topk(2).indices.tolist()
