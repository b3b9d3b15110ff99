"""Pick the next token for every sequence of a batch at once, each with its own sampling settings.

Sampling inverts each row's cumulative distribution at one uniform number: ``cumsum`` and
``searchsorted`` serve the whole batch, and a seeded request draws its single number per step from
its own generator (same seed, same params -> same tokens, whatever else is in the batch). Drawing
one number per row instead of one per vocabulary entry (the exponential-race trick) took a 64-row
step's sampling from 47 ms to about 1 ms on the CPU.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.protocol import SamplingParams, TokenLogprobs
from worker import kernels
from worker.guided import GuidedDecoding
from worker.request import Request

Sampled = tuple[list[int], list[TokenLogprobs | None]]  # one token per row, and its logprobs if asked for


class Sampler:
    """Batched greedy / temperature / top-k / top-p sampling with per-request seeds."""

    def __init__(self, device: torch.device, guided: GuidedDecoding | None = None) -> None:
        self.device = device
        self.guided = guided
        self.fused = device.type == "cpu" and kernels.load()  # plain temperature sampling in C++
        self._generators: dict[str, torch.Generator] = {}

    def add_request(self, request_id: str, seed: int | None) -> None:
        if seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request_id] = generator

    def remove_request(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.guided is not None:
            self.guided.remove(request_id)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> Sampled:
        """``logits`` is ``[batch, vocab]``, one row per request; returns one token id per row."""
        chosen = self._choose(logits, requests)
        tokens = chosen.tolist()
        if self.guided is not None:
            self.guided.accept(requests, tokens)
        return tokens, _logprobs(logits, chosen, requests)

    def _choose(self, raw_logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        request_ids = [r.request_id for r in requests]
        params = [r.sampling for r in requests]
        greedy_only = all(p.temperature == 0 for p in params)
        plain = self.fused and all(_plain(p) for p in params)
        # The torch path below works in place, and the caller's logits stay raw for logprobs: a copy,
        # unless no row's logits change and the choice only reads them (argmax, the C++ inverse CDF).
        reads_only = (greedy_only or plain) and raw_logits.dtype == torch.float32
        logits = (
            raw_logits
            if reads_only and not any(map(_changes_logits, requests))
            else self._changed(raw_logits, requests)
        )
        if greedy_only:
            return self._argmax(logits)
        if plain:
            return self._sample_plain(logits, request_ids, params)
        greedy = self._argmax(logits) if any(p.temperature == 0 for p in params) else None
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        uniform = self._uniform(request_ids, logits.device)
        probs = _unnormalized_probs(logits, params, temperature)
        cdf = probs.cumsum_(dim=-1)
        # The first token whose cumulative probability exceeds u; masked tokens add nothing, so never win.
        sampled = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        sampled = sampled.clamp(max=cdf.shape[-1] - 1)
        return sampled if greedy is None else torch.where(temperature > 0, sampled, greedy)

    def _changed(self, raw_logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """A float32 copy with penalties, bias, min_tokens, grammars and forced tokens applied."""
        logits = _adjust(_float_copy(raw_logits), requests)
        if self.guided is not None:
            logits = self.guided.mask(logits, requests)
        return _force(logits, requests)

    def _uniform(self, request_ids: list[str], device: torch.device) -> torch.Tensor:
        """One uniform number per row; a seeded request's from its own generator."""
        uniform = torch.rand(len(request_ids), device=device)
        for row, request_id in enumerate(request_ids):
            generator = self._generators.get(request_id)
            if generator is not None:
                uniform[row] = torch.rand(1, generator=generator, device=device)[0]
        return uniform

    def _sample_plain(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> torch.Tensor:
        """Rows shaped by temperature alone: the inverse CDF in one C++ call (worker/kernels), which
        only reads the logits; ~10 torch ops took 0.4-0.6 ms a batch-1 step."""
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        uniform = self._uniform(request_ids, logits.device)
        return kernels.ops().sample_temperature(logits.contiguous(), temperature, uniform)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's greedy pick: torch's argmax, or the same index from the C++ kernels on the calling
        thread (torch's is a scalar reduction in an OpenMP region, 0.1-0.2 ms a row of 49,152)."""
        return kernels.ops().argmax_rows(logits.contiguous()) if self.fused else logits.argmax(dim=-1)

    def verify(
        self, raw_logits: torch.Tensor, request: Request, drafts: list[int]
    ) -> tuple[list[int], list[TokenLogprobs] | None]:
        """Check ``drafts`` against the model: ``raw_logits[i]`` is the distribution after the last
        token and the first ``i`` drafts. Returns the emitted tokens (the accepted drafts, then one
        token of the model's own) and, if asked for, their logprobs.

        Greedy: a draft is accepted while it is the argmax, so the output is exactly plain greedy
        decoding's. Sampled: draft d at a position whose target distribution is p is accepted with
        probability p(d); on rejection the token is drawn from p with d removed (renormalised).
        That is rejection sampling for a draft distribution concentrated on d, and every emitted
        token is distributed exactly as plain sampling's.
        """
        rows = _draft_positions(request, drafts)
        logits = _adjust(_float_copy(raw_logits), rows)
        params = request.sampling
        if params.temperature == 0:
            targets = logits.argmax(dim=-1).tolist()
            accepted = next((i for i, draft in enumerate(drafts) if targets[i] != draft), len(drafts))
            emitted = targets[: accepted + 1]
        else:
            temperature = torch.full((len(rows),), params.temperature, device=logits.device)
            probs = _unnormalized_probs(logits, [params] * len(rows), temperature)
            probs = probs.div_(probs.sum(dim=-1, keepdim=True))
            uniform = torch.rand(len(rows), device=logits.device)
            draft_probs = probs[
                torch.arange(len(drafts), device=logits.device),
                torch.tensor(drafts, device=logits.device, dtype=torch.long),
            ]
            rejected = (uniform[: len(drafts)] >= draft_probs).tolist()
            accepted = rejected.index(True) if True in rejected else len(drafts)
            last = probs[accepted]
            if accepted < len(drafts):  # the residual: the target without the rejected draft
                last = last.clone()
                last[drafts[accepted]] = 0.0
            emitted = [*drafts[:accepted], _draw(last, uniform[-1])]
        chosen = torch.tensor(emitted, device=raw_logits.device)
        logprobs = _logprobs(raw_logits[: len(emitted)], chosen, rows[: len(emitted)])
        return emitted, None if params.logprobs is None else logprobs


def _force(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Rows whose thinking budget is spent take the end marker, whatever the sampling: every other
    token at -inf (greedy and sampled alike then pick it)."""
    for row, request in enumerate(requests):
        token = request.reasoning.forced() if request.reasoning is not None else None
        if token is not None:
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0
    return logits


def _changes_logits(request: Request) -> bool:
    """Whether the row's logits change before its choice (``_adjust``, a grammar, ``_force``): then
    the choice works on a copy, and the raw logits stay for logprobs."""
    return (
        _adjusted(request.sampling)
        or request.guide is not None
        or (request.reasoning is not None and request.reasoning.forced() is not None)
    )


def _adjusted(p: SamplingParams) -> bool:
    """Whether ``_adjust`` changes the row: penalties, logit bias or min_tokens (most rows: no)."""
    return bool(
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias or p.min_tokens
    )


def _plain(p: SamplingParams) -> bool:
    """Temperature alone shapes the distribution (no top-k, top-p or min-p)."""
    return p.temperature > 0 and p.top_k == 0 and p.top_p >= 1.0 and p.min_p == 0


def _draft_positions(request: Request, drafts: list[int]) -> list[Request]:
    """The request as it stands at each verified position (its drafts so far appended), for the
    adjustments that depend on the tokens before (penalties, min_tokens); the request itself where
    none does, with no copies."""
    p = request.sampling
    if not (
        p.presence_penalty
        or p.frequency_penalty
        or p.repetition_penalty != 1.0
        or (p.min_tokens and len(request.generated_token_ids) < p.min_tokens)
    ):
        return [request] * (len(drafts) + 1)
    return [replace(request, token_ids=request.token_ids + drafts[:i]) for i in range(len(drafts) + 1)]


def _unnormalized_probs(logits: torch.Tensor, params: list[SamplingParams], temperature: torch.Tensor) -> torch.Tensor:
    """Each row's sampling distribution, in place, up to a factor (its largest entry is 1):
    temperature (rows at 0 keep theirs), top-k, top-p, then min-p."""
    logits = logits.div_(torch.where(temperature > 0, temperature, 1.0).unsqueeze(1))
    logits = _apply_top_k_top_p(logits, params)
    # Unnormalised probabilities (the largest is 1): inverting the CDF needs no normalising, and
    # skipping softmax's extra passes over [batch, vocab] halved sampling time at 64 rows (6 -> 2.8 ms).
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        probs = probs.masked_fill_(probs < min_p, 0.0)
    return probs


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> int:
    """The token of one row of (unnormalised) probabilities at the uniform number ``uniform``."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, (uniform * cdf[-1]).reshape(1), right=True)
    return int(index.clamp(max=cdf.shape[-1] - 1)[0])


def _float_copy(logits: torch.Tensor) -> torch.Tensor:
    """A float32 copy to work on in place. ``clone``, not ``.to(float32, copy=True)``: that one is an
    OpenMP region, which waits for the second thread (~1 ms, up to 13 ms under load) whenever the
    gateway or another process holds the other core; clone copies on the calling thread (6 us)."""
    return logits.clone() if logits.dtype == torch.float32 else logits.float()


def _logprobs(raw_logits: torch.Tensor, chosen: torch.Tensor, requests: list[Request]) -> list[TokenLogprobs | None]:
    """The chosen token's log-probability and the ``k`` most likely, for the rows that ask."""
    result: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    if not rows:
        return result
    index = torch.tensor(rows, device=raw_logits.device)
    logprobs = raw_logits.index_select(0, index).float().log_softmax(dim=-1)
    picked = logprobs.gather(1, chosen.index_select(0, index).unsqueeze(1)).squeeze(1).tolist()
    k = max(requests[i].sampling.logprobs for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, row in enumerate(rows):
        want = requests[row].sampling.logprobs
        result[row] = TokenLogprobs(picked[j], top_ids[j][:want], top_values[j][:want])
    return result


def prompt_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Logprobs of known next tokens (``targets[i]`` follows the position of ``logits[i]``) and the
    ``k`` most likely at each position: the prompt's own logprobs, from the raw distribution."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, torch.tensor(targets, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    if k == 0:
        return [TokenLogprobs(value) for value in picked]
    top_values, top_ids = logprobs.topk(k, dim=-1)
    return [
        TokenLogprobs(value, ids, values) for value, ids, values in zip(picked, top_ids.tolist(), top_values.tolist())
    ]


def _adjust(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Penalties, logit bias and min_tokens, in place, for the rows that ask for them (most don't)."""
    vocab = logits.shape[-1]
    for row, request in enumerate(requests):
        p = request.sampling
        if not _adjusted(p):
            continue  # the common case: nothing to do, not even a copy of the generated tokens
        output = request.generated_token_ids
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=vocab)[:vocab].float()
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.token_ids)), device=logits.device)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
        if len(output) < p.min_tokens and request.stop_token_ids:
            logits[row, torch.tensor(sorted(request.stop_token_ids), device=logits.device)] = float("-inf")
    return logits


# How many of a row's largest logits a top-p nucleus is first looked for in. Sorting the whole
# vocabulary took 5.4 ms a step for one row (49k tokens); a nucleus is nearly always a few hundred
# tokens (0.28 ms). If the candidates cannot be shown to hold it, the whole row is sorted.
NUCLEUS_CANDIDATES = 256


def _apply_top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask to -inf everything outside each row's top-k and top-p nucleus.

    Only the rows that ask, and only their largest logits: the ``c`` best of each row (``c`` at
    least every row's ``top_k``), in one stable order (ties: lowest id as the most likely, so a tiny
    top_p keeps the token argmax picks; bf16 logits tie at the top often). For a top-p row without
    top_k the tokens left out must be excluded anyway: their mass must be within ``1 - top_p`` and
    strictly smaller than every candidate's, or the whole vocabulary is sorted.
    """
    vocab = logits.shape[-1]
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if not rows:
        return logits
    chosen = [params[i] for i in rows]
    sub = logits[rows]
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in chosen], device=logits.device)
    top_p = torch.tensor([p.top_p for p in chosen], device=logits.device)
    unbounded = k == vocab  # top-p rows whose nucleus is not capped by a top_k
    lse = sub.logsumexp(dim=-1, keepdim=True)
    size = max(k[~unbounded].tolist(), default=0)
    if bool(unbounded.any()):
        size = max(size, NUCLEUS_CANDIDATES)
    size = min(size, vocab)
    ascending = ids = None
    if size < vocab:
        values, ids = sub.topk(size + 1, dim=-1)
        tail_mass = 1.0 - (values[:, :size] - lse).exp().sum(dim=-1)
        separated = values[:, size - 1] > values[:, size]
        if bool((~unbounded | ((tail_mass <= 1.0 - top_p) & separated)).all()):
            # Ascending by value, ties by descending id (stable sorts), so the lowest id of a tie comes last.
            ids, by_id = ids[:, :size].sort(dim=-1, descending=True)
            ascending, order = values[:, :size].gather(1, by_id).sort(dim=-1, stable=True)
            ids = ids.gather(1, order)
    if ascending is None:  # the whole row: one stable descending sort, flipped
        size = vocab
        descending, ids = sub.sort(dim=-1, descending=True, stable=True)
        ascending, ids = descending.flip(-1), ids.flip(-1)
    if bool((k < vocab).any()):
        kth = ascending.gather(1, (size - k.clamp(max=size)).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    if bool((top_p < 1.0).any()):
        # Probabilities over what top-k left: the candidates alone for top-k rows, the whole row
        # (the candidates plus a tail that is all excluded) for the others.
        total = torch.where(unbounded.unsqueeze(1), lse, ascending.logsumexp(dim=-1, keepdim=True))
        probs = (ascending - total).exp()
        tail = (1.0 - probs.sum(dim=-1, keepdim=True)).clamp(min=0.0) * unbounded.unsqueeze(1)
        cumulative = tail + probs.cumsum(dim=-1)
        outside = cumulative <= (1.0 - top_p).unsqueeze(1)
        outside[:, -1] = False  # the most likely token always stays
        ascending = ascending.masked_fill(outside, float("-inf"))
    kept = torch.full_like(sub, float("-inf")).scatter_(1, ids, ascending)
    if len(rows) == len(params):
        return kept
    logits[rows] = kept
    return logits
