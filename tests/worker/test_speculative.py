"""Speculative decoding (worker/speculative.py): drafts, their verification, and that a request's
output, stops, lengths, logprobs, KV blocks and prefix cache come out as without it."""

from collections import Counter

import pytest
import torch

from common.config import CACHE_DIR
from common.model_source import load_tokenizer, resolve_model
from common.protocol import NewRequest, SamplingParams
from tests.worker.factories import drain, tokens
from worker.block_manager import chain_hash
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.request import Request
from worker.sampler import Sampler
from worker.speculative import propose

MODEL = "SmolLM2-135M-Instruct"
TEXT = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. All that glitters is not gold."


def test_propose_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    assert propose([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 3) == [7, 8, 5]  # "2 3" last seen before 7 (and "5 2 3" never)
    assert propose([4, 1, 2, 3, 6, 6, 1, 2, 3], 2) == [6, 6]  # the 3-gram wins over later 1-gram matches
    assert propose([1, 2, 3, 4, 5], 3) == []  # nothing recurs
    assert propose([7, 7, 7], 4) == [7]  # overlapping with the suffix itself; as far as the sequence goes
    assert propose([5, 1, 2], 0) == []


def _prompt(content: str) -> list[int]:
    tokenizer = load_tokenizer(resolve_model(MODEL), CACHE_DIR.env_default())
    messages = [{"role": "user", "content": content}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
        "input_ids"
    ]


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    return {
        "repeat": _prompt(f"Repeat this text exactly, word for word:\n\n{TEXT}"),
        "list": _prompt("Count from 1 to 30, one number per line."),
        "chat": _prompt("What is the capital of France? Explain briefly."),
        "story": _prompt("Write a short story about a robot who learns to paint."),
    }


@pytest.fixture(scope="module")
def engine32() -> Engine:
    return build_engine(resolve_model(MODEL), WorkerConfig(dtype="float32", kv_cache_memory="64MiB", speculate=4))


def run(engine: Engine, k: int, news: list[NewRequest]) -> dict[str, list]:
    """Every output of each request with ``k`` drafts a step; checks that no block leaks."""
    engine.speculator.k = k
    return drain(engine, news)


def greedy(name: str, prompt: list[int], max_tokens: int = 40, **sampling) -> NewRequest:
    return NewRequest(name, prompt, max_tokens, SamplingParams(temperature=0, **sampling))


@pytest.fixture(scope="module")
def plain(engine32, prompts) -> dict[str, list[int]]:
    """Each prompt's greedy output without speculation."""
    return {name: tokens(run(engine32, 0, [greedy(name, p)])[name]) for name, p in prompts.items()}


@pytest.mark.parametrize("k", [2, 5])
def test_greedy_output_is_token_identical_to_plain_decoding_in_float32(engine32, prompts, plain, k):
    before = engine32.load()
    spec = {name: tokens(run(engine32, k, [greedy(name, p)])[name]) for name, p in prompts.items()}
    assert spec == plain
    load = engine32.load()
    proposed = load.spec_proposed_tokens - before.spec_proposed_tokens
    accepted = load.spec_accepted_tokens - before.spec_accepted_tokens
    assert 0 < accepted <= proposed


def test_the_prefix_cache_only_ever_holds_the_tokens_of_the_sequence(engine32, prompts):
    """Rejected drafts' keys and values are never registered: every cached block is a chunk of the
    real sequence, and a warm rerun of prompt + output (served from those blocks) reads the same."""
    prompt = prompts["repeat"]
    out = tokens(run(engine32, 4, [greedy("a", prompt)])["a"])
    sequence = prompt + out
    size = engine32.blocks.block_size
    expected, parent = set(), None
    for start in range(0, len(sequence) - size + 1, size):
        parent = chain_hash(parent, tuple(sequence[start : start + size]))
        expected.add(parent)
    cached = {b.block_hash for b in engine32.blocks.blocks if b.block_hash is not None}
    assert len(cached & expected) >= (len(sequence) - 1) // size  # every block full of computed tokens is registered
    continued = greedy("b", sequence, 8)
    warm = tokens(run(engine32, 4, [continued])["b"])
    cold = tokens(
        run(
            build_engine(
                resolve_model(MODEL), WorkerConfig(dtype="float32", kv_cache_memory="64MiB", prefix_caching=False)
            ),
            0,
            [continued],
        )["b"]
    )
    assert warm == cold


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(engine32, prompts, plain):
    prompt, plain = prompts["repeat"], plain["repeat"]
    stop = plain[20]  # some token well inside the output, which drafts predict
    cut = plain.index(stop) + 1
    out = run(engine32, 5, [NewRequest("s", prompt, 48, SamplingParams(temperature=0), stop_token_ids=[stop])])["s"]
    assert tokens(out) == plain[:cut]
    assert out[-1].finish_reason == "stop" and out[-1].num_output_tokens == cut
    assert [o.seq for o in out] == list(range(len(out)))


@pytest.mark.parametrize("max_tokens", [1, 2, 13])
def test_max_tokens_ends_a_speculating_request_at_the_same_token(engine32, prompts, plain, max_tokens):
    out = run(engine32, 5, [greedy("m", prompts["repeat"], max_tokens)])["m"]
    assert tokens(out) == plain["repeat"][:max_tokens]
    assert out[-1].finish_reason == "length" and out[-1].num_output_tokens == max_tokens


def test_logprobs_come_for_every_emitted_token_and_match_plain_decoding(engine32, prompts):
    prompt = prompts["repeat"]
    plain = run(engine32, 0, [greedy("p", prompt, 24, logprobs=2)])["p"]
    before = engine32.load().spec_accepted_tokens
    spec = run(engine32, 4, [greedy("l", prompt, 24, logprobs=2)])["l"]
    assert engine32.load().spec_accepted_tokens > before, "drafts were accepted, so some outputs hold several tokens"
    assert tokens(spec) == tokens(plain)
    assert all(len(o.logprobs) == len(o.new_token_ids) for o in spec)
    plain_lp = [lp for o in plain for lp in o.logprobs]
    spec_lp = [lp for o in spec for lp in o.logprobs]
    for a, b in zip(plain_lp, spec_lp, strict=True):
        assert a.top_ids == b.top_ids and abs(a.logprob - b.logprob) < 1e-3


def test_seeded_sampled_requests_decode_without_drafts_and_unseeded_ones_speculate(engine32, prompts):
    """A seed fixes the output only if each step draws one number, so seeded requests never speculate."""
    before = engine32.load().spec_proposed_tokens
    seeded = [NewRequest("seeded", prompts["repeat"], 16, SamplingParams(temperature=0.7, seed=3))]
    assert tokens(run(engine32, 4, seeded)["seeded"]) == tokens(run(engine32, 0, seeded)["seeded"])
    assert engine32.load().spec_proposed_tokens == before
    out = run(
        engine32, 4, [NewRequest("sampled", prompts["repeat"], 32, SamplingParams(temperature=0.3), ignore_eos=True)]
    )["sampled"]
    assert len(tokens(out)) == 32 and out[-1].finish_reason == "length"
    assert engine32.load().spec_accepted_tokens > 0


def test_greedy_output_is_the_same_through_the_cpp_decode_step():
    """The default settings (bf16 where the CPU computes it, else float32; q4 weights for this Q4_1
    model): the verify step runs as rows of the fused C++ step sharing one block table."""
    engine = build_engine(resolve_model(MODEL), WorkerConfig(kv_cache_memory="64MiB"))
    if not engine.runner.paths.fast:
        pytest.skip("the C++ kernels are not available here")
    assert engine.runner.quantization == "q4"
    prompt = _prompt(f"Repeat this text exactly, word for word:\n\n{TEXT}")
    plain = tokens(run(engine, 0, [greedy("p", prompt)])["p"])
    spec = tokens(run(engine, 5, [greedy("s", prompt)])["s"])
    assert spec == plain
    assert engine.load().spec_accepted_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution():
    """Sampled requests: the first token after a draft is distributed as the target whether the
    draft is its most or least likely token, and so is the next one when the draft was accepted."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 1.5, 0.3, 0.2, -0.5]])
    target = [logits[i].softmax(-1) for i in range(2)]
    sampler = Sampler(torch.device("cpu"))
    request = Request("r", [1, 2, 3], 3, 8, SamplingParams(temperature=1.0), frozenset())
    trials = 10000
    for draft in (0, 3):
        first, second = Counter(), Counter()
        for _ in range(trials):
            emitted, _ = sampler.verify(logits, request, [draft])
            first[emitted[0]] += 1
            if len(emitted) == 2:
                second[emitted[1]] += 1
        assert sum(second.values()) == first[draft]  # two tokens exactly when the draft was accepted
        for token in range(5):
            assert abs(first[token] / trials - target[0][token].item()) < 0.02
        if draft == 0:  # accepted often enough to measure the next token's distribution
            for token in range(5):
                assert abs(second[token] / first[draft] - target[1][token].item()) < 0.03
