"""Batched sampling with per-row settings."""

import pytest
import torch

from common.protocol import SamplingParams
from worker.request import Request
from worker.sampler import Sampler, _apply_top_k_top_p


class TokensOnly(Sampler):
    """The sampler with its logprobs dropped: most tests look at the chosen tokens only."""

    def __call__(self, logits, requests):
        return super().__call__(logits, requests)[0]


def reqs(ids, params, outputs=None):
    """Requests with a 3-token prompt (and optional generated tokens) and the given sampling."""
    outputs = outputs or [[] for _ in params]
    return [Request(i, [1, 2, 3] + out, 3, 100, p, frozenset({0})) for i, p, out in zip(ids, params, outputs)]


def logits(rows: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))


def test_greedy_is_argmax():
    x = logits()
    assert (
        TokensOnly(torch.device("cpu"))(x, reqs(list("abcd"), [SamplingParams(temperature=0)] * 4))
        == x.argmax(-1).tolist()
    )


def test_top_k_1_and_tiny_top_p_are_greedy_even_when_hot():
    x = logits()
    sampler = TokensOnly(torch.device("cpu"))
    params = [SamplingParams(temperature=2.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)] * 2
    for _ in range(5):
        assert sampler(x, reqs(list("abcd"), params)) == x.argmax(-1).tolist()


def test_tiny_top_p_breaks_a_tie_at_the_top_as_argmax_does():
    # bf16 logits often tie at the top; the nucleus must keep the token greedy would pick (the lowest id).
    x = torch.zeros(1, 300, dtype=torch.bfloat16)
    x[0, [41, 7, 250, 123]] = 3.0
    sampler = TokensOnly(torch.device("cpu"))
    picks = {sampler(x, reqs(["a"], [SamplingParams(temperature=1.0, top_p=1e-6)]))[0] for _ in range(20)}
    assert picks == {x[0].float().argmax().item()} == {7}


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat (whole-row sort) to peaked (a few hundred candidates)
def test_top_k_and_top_p_keep_what_a_full_sort_keeps(scale):
    torch.manual_seed(int(scale * 10))
    x = torch.randn(4, 49152) * scale
    x[0, :3] = x[0].max()  # a tie at the top
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.5, top_k=40),
        SamplingParams(top_k=7),
        SamplingParams(top_p=0.99),
    ]
    kept = ~_apply_top_k_top_p(x.clone(), params).isinf()
    for row, p in enumerate(params):
        order = x[row].sort(descending=True, stable=True).indices  # ties: lowest id first (most likely)
        k = p.top_k or x.shape[1]
        probs = x[row, order[:k]].softmax(-1)
        # A token stays while its mass plus that of the less likely ones exceeds 1 - top_p.
        at_or_after = probs.flip(0).cumsum(0).flip(0)
        n = k if p.top_p >= 1.0 else max(1, int((at_or_after > 1.0 - p.top_p).sum()))
        want = torch.zeros_like(kept[row])
        want[order[:n]] = True
        assert torch.equal(kept[row], want), f"row {row}: kept {int(kept[row].sum())}, want {n}"


def test_rows_mix_greedy_and_sampled():
    x = logits(rows=2)
    sampler = TokensOnly(torch.device("cpu"))
    out = sampler(x, reqs(["g", "s"], [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]))
    assert out[0] == x[0].argmax().item() and 0 <= out[1] < 50


def test_top_k_only_picks_among_the_k_best():
    x = logits(rows=1, vocab=100)
    allowed = set(x[0].topk(5).indices.tolist())
    sampler = TokensOnly(torch.device("cpu"))
    picks = {sampler(x, reqs(["a"], [SamplingParams(temperature=5.0, top_k=5)]))[0] for _ in range(200)}
    assert picks <= allowed and len(picks) > 1


def test_same_seed_same_tokens_whatever_the_batch():
    x = logits(rows=3, vocab=1000)
    params = [SamplingParams(temperature=1.5, seed=7)] * 3

    def run(ids: list[str]) -> list[int]:
        sampler = TokensOnly(torch.device("cpu"))
        for request_id in ids:
            sampler.add_request(request_id, 7)
        return [sampler(x, reqs(ids, params))[0] for _ in range(10)]

    assert run(["a", "b", "c"]) == run(["z", "y", "x"])
    unseeded = TokensOnly(torch.device("cpu"))
    draws = {tuple(unseeded(x, reqs(["a", "b", "c"], [SamplingParams(temperature=1.5)] * 3))) for _ in range(10)}
    assert len(draws) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_rows_that_change_no_logit_read_them_in_place_and_pick_as_the_copy_does(temperature):
    """Greedy and temperature-only rows choose on the caller's logits with no working copy; a zero
    logit bias sends the same rows through the copy, and the seeded picks agree draw for draw."""
    x = logits(rows=2, vocab=1000)
    before = x.clone()

    def draws(bias: dict[int, float]) -> list[list[int]]:
        torch.manual_seed(0)  # the unseeded row's numbers
        sampler = TokensOnly(torch.device("cpu"))
        sampler.add_request("a", 11)
        params = [SamplingParams(temperature=temperature, seed=11, logit_bias=bias), SamplingParams(temperature)]
        return [sampler(x, reqs(["a", "b"], params)) for _ in range(10)]

    assert draws({}) == draws({0: 0.0})
    assert torch.equal(x, before), "the caller's logits are left alone"


def test_samples_follow_the_distribution_and_never_pick_masked_tokens():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    x = torch.log(probs).repeat(4000, 1)  # -inf for the last token
    out = TokensOnly(torch.device("cpu"))(x, reqs(["r"] * 4000, [SamplingParams(temperature=1.0)] * 4000))
    counts = torch.bincount(torch.tensor(out), minlength=5).float() / 4000
    assert counts[4] == 0
    assert torch.allclose(counts[:4], probs[:4], atol=0.03), counts


def test_logit_bias_forces_and_bans_tokens_even_when_greedy():
    x = logits(rows=2)
    best = x[1].argmax().item()
    out = TokensOnly(torch.device("cpu"))(
        x,
        reqs(
            ["force", "ban"],
            [
                SamplingParams(temperature=0, logit_bias={7: 100.0}),
                SamplingParams(temperature=0, logit_bias={best: -100.0}),
            ],
        ),
    )
    assert out[0] == 7 and out[1] != best
    assert x[1].argmax().item() == best, "the caller's logits are left alone"


def test_penalties_push_away_from_tokens_already_generated():
    x = torch.full((1, 10), 0.5)
    x[0, 4] = 1.0  # the favourite...
    plain = TokensOnly(torch.device("cpu"))(x.clone(), reqs(["a"], [SamplingParams(temperature=0)], [[4, 4]]))
    assert plain == [4]
    for params in (
        SamplingParams(temperature=0, frequency_penalty=0.6),
        SamplingParams(temperature=0, presence_penalty=1.5),
        SamplingParams(temperature=0, repetition_penalty=3.0),
    ):
        assert TokensOnly(torch.device("cpu"))(x.clone(), reqs(["a"], [params], [[4, 4]])) != [4], params


def test_min_tokens_holds_back_stop_tokens_and_min_p_trims_the_tail():
    x = torch.zeros(1, 10)
    x[0, 0] = 5.0  # token 0 is the stop token of reqs()
    assert TokensOnly(torch.device("cpu"))(
        x.clone(), reqs(["a"], [SamplingParams(temperature=0, min_tokens=2)], [[3]])
    ) != [0]
    assert TokensOnly(torch.device("cpu"))(
        x.clone(), reqs(["a"], [SamplingParams(temperature=0, min_tokens=2)], [[3, 3]])
    ) == [0]
    y = torch.tensor([[3.0, 2.9, -5.0, -5.0, -5.0]])
    picks = {
        TokensOnly(torch.device("cpu"))(y, reqs(["a"], [SamplingParams(temperature=1.0, min_p=0.5)]))[0]
        for _ in range(100)
    }
    assert picks == {0, 1}


def test_logprobs_of_the_chosen_token_and_the_top_k_from_the_raw_distribution():
    x = logits(3)
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5, logprobs=0),
    ]
    tokens, lps = Sampler(torch.device("cpu"))(x, reqs(["a", "b", "c"], params))
    reference = x.log_softmax(-1)
    assert lps[1] is None
    assert lps[0].logprob == reference[0, tokens[0]].item()
    assert lps[0].top_ids == reference[0].topk(3).indices.tolist() and lps[0].top_ids[0] == tokens[0]
    assert lps[0].top_logprobs == sorted(lps[0].top_logprobs, reverse=True)
    assert lps[2].top_ids == [] and abs(lps[2].logprob - reference[2, tokens[2]].item()) < 1e-6
