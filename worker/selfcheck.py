"""The worker checks itself before it registers: a wrong answer must stop the start, not reach users.

Two fixed prompts go through the worker's own serving path (its paged cache, kernels, dtype and
weights): a short one prefilled whole, and one longer than the model's smallest sliding window or
attention chunk (so the window really cuts) prefilled in two chunks beside the first one's decode
step, then decode steps of both together and one of the long one alone. The tokens fed are fixed
and the short sequence is the long one's beginning, so one reference forward in transformers
(eager attention, same dtype) gives the logits of every position checked, computed up front (the
native forward frees transformers' layers). The tokens are drawn again (a few times at most) while
a checked position is a near-tie of more than five tokens, where rounding noise, not the step,
decides the top-5 rule (``TIE_MARGIN``).

The rule (vLLM's, as the tests use it): in float32 with unquantized weights, the same top token at
every position (near-ties within ``TIE`` aside) and logits within ``EXACT_TOLERANCE`` of the
largest one; otherwise each side's top token among the other's top 5. A miss refuses to start,
naming the architecture, the step where they part and, on transformers' classes, the first layer
whose attention output differs; ``--skip-self-check`` overrides it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.protocol import SamplingParams
from worker.attention import ATTENTION_NAME
from worker.attention.layers import LayerSpec
from worker.models.support import UnsupportedModel
from worker.request import Request
from worker.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from worker.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

SHORT_PROMPT = 8
DECODE_STEPS = 2  # decode steps of the short prompt beside the long one (which then takes one alone)
TIE = 1e-4  # float32: a top-token swap between logits closer than this (relative) is summation order
EXACT_TOLERANCE = 1e-3  # float32: largest logit difference allowed, relative to the largest logit
TOP_K = 5
# Quantized weights: a checked position where more than TOP_K tokens lie within this (relative to
# the largest logit) of the reference's top one tests rounding noise, not the step: which of the
# tied tokens wins there turns on the last bits of the prompt's cache (torch's AVX2 and AVX-512
# kernels differ there), so the self-check draws its tokens again, up to DRAWS times, to avoid one.
TIE_MARGIN = 0.02
DRAWS = 4  # each a reference forward of the long prompt (window + 5 tokens on a sliding-window model)


@dataclass(slots=True)
class CheckSequence:
    """One check sequence: its fixed tokens, and the reference logits of the positions we sample."""

    prompt: list[int]
    continuation: list[int]
    reference: torch.Tensor  # [len(continuation) + 1, vocab] float32: after the prompt, then after each fed token


class SelfCheck:
    """Made before the native forward is built (the reference runs transformers' layers); ``run``
    once the runner is complete."""

    def __init__(self, model: torch.nn.Module, layers: list[LayerSpec], max_model_len: int, block_size: int) -> None:
        started = time.perf_counter()
        self.model = model
        vocab = model.config.get_text_config().vocab_size
        sizes = [layer.mask.local_size for layer in layers if layer.mask.local_size]
        window = min(sizes) if sizes else None
        generator = torch.Generator().manual_seed(20261124)
        long_len = max(block_size, window or 0) + 5  # past a block and the window, not block-aligned
        long_len = max(SHORT_PROMPT + DECODE_STEPS, min(long_len, max_model_len - DECODE_STEPS - 2))
        self.window = window if window is not None and long_len > window else None  # the window cuts the long prompt
        # The short sequence is the long one's beginning, so one reference forward gives both's logits.
        best = None
        for self.draws in range(1, DRAWS + 1):  # the draw whose checked positions are furthest from a near-tie
            tokens = torch.randint(0, vocab, (long_len + DECODE_STEPS + 1,), generator=generator).tolist()
            logits = (
                reference_logits(model, tokens, len(tokens) - SHORT_PROMPT + 1).float().cpu()
            )  # from position SHORT_PROMPT - 1 on
            at = long_len - SHORT_PROMPT  # the long prompt's last token
            checked = torch.cat([logits[: DECODE_STEPS + 1], logits[at : at + DECODE_STEPS + 1]])  # the rows compared
            if best is None or tie_margin(checked) > best[0]:
                best = (tie_margin(checked), tokens, logits)
            if best[0] >= TIE_MARGIN:
                break
        self.margin, tokens, logits = best
        self.sequences = [
            CheckSequence(
                tokens[:SHORT_PROMPT], tokens[SHORT_PROMPT : SHORT_PROMPT + DECODE_STEPS], logits[: DECODE_STEPS + 1]
            ),
            CheckSequence(tokens[:long_len], tokens[long_len:], logits[long_len - SHORT_PROMPT :]),
        ]
        self.reference_s = time.perf_counter() - started

    @torch.inference_mode()
    def run(self, runner: ModelRunner) -> None:
        started = time.perf_counter()
        exact = runner.dtype == torch.float32 and runner.quantization == "none"
        short, long = (self._request(i, sequence, runner) for i, sequence in enumerate(self.sequences))
        blocks_needed = sum(len(r.block_ids) for r in (short, long))
        if blocks_needed > runner.num_blocks:
            log.warning(
                "self-check skipped: it needs %d KV blocks and the cache holds %d", blocks_needed, runner.num_blocks
            )
            return
        half = long.num_prompt_tokens // 2
        steps = [
            ("a whole prompt's last token", [(short, SHORT_PROMPT), (long, half)]),
            (
                "the last token of a prompt prefilled in two chunks, beside another sequence's decode step",
                [(short, 1), (long, long.num_prompt_tokens - half)],
            ),
        ]
        steps += [
            (f"decode step {i + 1} of two sequences batched", [(short, 1), (long, 1)]) for i in range(DECODE_STEPS - 1)
        ]
        steps.append(("a lone decode step", [(long, 1)]))
        seen = {short.request_id: 0, long.request_id: 0}
        for stage, work in steps:
            batch = ScheduledBatch([r for r, _ in work], [n for _, n in work])
            logits, sampled = runner.logits(batch)
            for request, n in work:
                request.num_computed_tokens += n
            for row, request in enumerate(sampled):
                index = int(request.request_id)
                sequence = self.sequences[index]
                problem = compare(logits[row].float().cpu(), sequence.reference[seen[request.request_id]], exact)
                if problem is not None:
                    raise UnsupportedModel(self._failure(runner, stage, problem, sequence, exact))
                if seen[request.request_id] < len(sequence.continuation):
                    request.token_ids.append(sequence.continuation[seen[request.request_id]])
                seen[request.request_id] += 1
        log.info(
            "self-check passed in %.2f s (reference %.2f s, %d draw(s), tie margin %.3f): %d positions against "
            "transformers' eager forward, %s%s",
            time.perf_counter() - started + self.reference_s,
            self.reference_s,
            self.draws,
            self.margin,
            sum(seen.values()),
            "float32 top tokens and logits" if exact else f"top-{TOP_K} closeness",
            f", one prompt past the {self.window}-token window" if self.window else "",
        )
        self.model = None  # the reference's logits and the model reference are not needed any more
        self.sequences = []

    def _request(self, index: int, sequence: CheckSequence, runner: ModelRunner) -> Request:
        total = len(sequence.prompt) + len(sequence.continuation)
        first = 0 if index == 0 else -(-(SHORT_PROMPT + DECODE_STEPS) // runner.block_size)
        blocks = list(range(first, first + -(-total // runner.block_size)))
        request = Request(
            str(index),
            list(sequence.prompt),
            len(sequence.prompt),
            len(sequence.continuation),
            SamplingParams(temperature=0),
            frozenset(),
        )
        request.block_ids = blocks
        return request

    def _failure(self, runner: ModelRunner, stage: str, problem: str, sequence: CheckSequence, exact: bool) -> str:
        notes = []
        if runner.native is not None:
            notes.append(
                f"prompts run the native forward ({type(runner.native).__module__}; --model-impl transformers may serve it)"
            )
        else:
            layer = first_differing_layer(runner, sequence.prompt, 1e-4 if exact else 5e-2)
            notes.append(
                f"the first attention layer whose output differs on the prompt is {layer}"
                if layer
                else "a prompt alone matches layer by layer"
            )
        if runner.paths.fast:
            notes.append(
                "decode steps run the fused C++ step (worker/models/fused_decode.py; float32 without quantization keeps the torch path)"
            )
        return (
            f"{runner.architecture} failed the start-up self-check against transformers' own forward in "
            f"{str(runner.dtype).removeprefix('torch.')}: at {stage}, {problem}; {'; '.join(notes)}. The worker would serve wrong text, "
            "so it does not start; --skip-self-check starts it anyway"
        )


def compare(ours: torch.Tensor, reference: torch.Tensor, exact: bool) -> str | None:
    """None when ``ours`` passes against ``reference`` (both ``[vocab]``), else what is wrong."""
    mine, theirs = int(ours.argmax()), int(reference.argmax())
    if exact:
        scale = float(reference.abs().max()) + 1e-6
        gap = float(reference[theirs] - reference[mine]) / scale
        if mine != theirs and gap > TIE:
            return f"the top token is {mine}, where the reference's is {theirs}"
        error = float((ours - reference).abs().max()) / scale
        if error > EXACT_TOLERANCE:
            return f"logits differ by up to {error:.2g} of the largest (allowed: {EXACT_TOLERANCE:g})"
        return None
    if mine not in reference.topk(TOP_K).indices or theirs not in ours.topk(TOP_K).indices:
        return f"the top token {mine} and the reference's {theirs} are not each in the other's top {TOP_K}"
    return None


def tie_margin(logits: torch.Tensor) -> float:
    """The smallest gap, over the rows of ``logits`` ``[positions, vocab]``, between the top logit
    and the (TOP_K + 1)-th, relative to the row's largest magnitude."""
    top = logits.topk(TOP_K + 1, dim=-1).values
    return float(((top[:, 0] - top[:, -1]) / (logits.abs().amax(dim=-1) + 1e-6)).min())


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, tokens: list[int], last: int = 0) -> torch.Tensor:
    """``[last or len(tokens), vocab]``: the logits of the ``last`` positions (0: all) from
    transformers' forward with eager attention (the model left on paged attention)."""
    model.set_attn_implementation("eager")
    try:
        return model(
            input_ids=torch.tensor([tokens], device=model.device), use_cache=False, logits_to_keep=last
        ).logits[0]
    finally:
        model.set_attn_implementation(ATTENTION_NAME)


def first_differing_layer(runner: ModelRunner, prompt: list[int], tolerance: float) -> str | None:
    """The first layer whose attention output on ``prompt`` (prefilled whole) differs between the
    reference forward and the serving path, described with its mask and features."""
    outputs: dict[str, list[torch.Tensor]] = {"reference": [], "serving": []}
    run = "reference"

    def keep(_module: torch.nn.Module, _args: object, out: object) -> None:
        outputs[run].append((out[0] if isinstance(out, tuple) else out).float().cpu())

    hooks = [runner.model.get_submodule(layer.module).register_forward_hook(keep) for layer in runner.layers]
    try:
        reference_logits(runner.model, prompt)
        run = "serving"
        request = Request("diagnosis", list(prompt), len(prompt), 1, SamplingParams(temperature=0), frozenset())
        request.block_ids = list(range(-(-len(prompt) // runner.block_size)))
        runner.logits(ScheduledBatch([request], [len(prompt)]))
    finally:
        for hook in hooks:
            hook.remove()
    for index, (want, got) in enumerate(zip(outputs["reference"], outputs["serving"])):
        if float((want - got.reshape(want.shape)).abs().max()) > tolerance * (float(want.abs().max()) + 1e-6):
            return runner.layers[index].describe() if index < len(runner.layers) else f"layer {index}"
    return None
