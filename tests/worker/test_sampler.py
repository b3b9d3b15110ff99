"""Batched sampling with per-row settings."""

import torch

from common.protocol import SamplingParams
from worker.sampler import Sampler


def logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(torch.device("cpu"))(x, list("abcd"), [SamplingParams(temperature=0)] * 4) == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_are_greedy_even_when_hot():
    x = logits()
    sampler = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)] * 2
    for _ in range(5):
        assert sampler(x, list("abcd"), params) == x.argmax(-1).tolist()


def test_rows_mix_greedy_and_sampled():
    x = logits(rows=2)
    sampler = Sampler(torch.device("cpu"))
    out = sampler(x, ["g", "s"], [SamplingParams(temperature=0), SamplingParams(temperature=1.0)])
    assert out[0] == x[0].argmax().item() and 0 <= out[1] < 50


def test_top_k_only_picks_among_the_k_best():
    x = logits(rows=1, vocab=100)
    allowed = set(x[0].topk(5).indices.tolist())
    sampler = Sampler(torch.device("cpu"))
    picks = {sampler(x, ["a"], [SamplingParams(temperature=5.0, top_k=5)])[0] for _ in range(200)}
    assert picks <= allowed and len(picks) > 1


def test_same_seed_same_tokens_whatever_the_batch():
    x = logits(rows=3, vocab=1000)
    params = [SamplingParams(temperature=1.5, seed=7)] * 3

    def run(ids: list[str]) -> list[int]:
        sampler = Sampler(torch.device("cpu"))
        for request_id in ids:
            sampler.add_request(request_id, 7)
        return [sampler(x, ids, params)[0] for _ in range(10)]

    assert run(["a", "b", "c"]) == run(["z", "y", "x"])
    unseeded = Sampler(torch.device("cpu"))
    draws = {tuple(unseeded(x, ["a"] * 3, [SamplingParams(temperature=1.5)] * 3)) for _ in range(10)}
    assert len(draws) > 1


def test_samples_follow_the_distribution_and_never_pick_masked_tokens():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    x = torch.log(probs).repeat(4000, 1)  # -inf for the last token
    out = Sampler(torch.device("cpu"))(x, ["r"] * 4000, [SamplingParams(temperature=1.0)] * 4000)
    counts = torch.bincount(torch.tensor(out), minlength=5).float() / 4000
    assert counts[4] == 0
    assert torch.allclose(counts[:4], probs[:4], atol=0.03), counts
