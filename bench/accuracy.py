"""Accuracy of the fast decode paths against transformers' ``generate`` (``python -m bench.accuracy``).

For a fixed prompt set, each mode's greedy output (one request at a time, so the small-batch decode
path runs) is compared with bf16 ``generate``:
- exact: the share of prompts whose tokens are all identical;
- close: the share passing vLLM's closeness test (where the texts diverge, each side's token is among
  the other's top-5 logprobs);
- diverge@: mean position of the first differing token (NEW_TOKENS when none differs);
- |dlogp|: mean absolute difference of the chosen tokens' logprobs over the shared prefix.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

PROMPTS = [
    "What is the capital of France?",
    "Tell me something interesting about the ocean.",
    "Write a haiku about autumn leaves.",
    "Explain what a prime number is to a child.",
    "List three uses of a paperclip.",
    "How do I boil an egg?",
    "What is the difference between weather and climate?",
    "Give me a short motivational quote.",
    "Translate 'good morning' into Spanish and French.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What are the planets of the solar system?",
    "Write a Python function that reverses a string.",
    "Suggest a name for a friendly robot.",
    "What should I pack for a weekend hiking trip?",
    "Describe the taste of a lemon.",
]
NEW_TOKENS = 32
TOP = 5
MODES = {  # name: (WorkerConfig fields, rows the C++ decode kernel may take)
    "bf16-torch": ({"dtype": "bfloat16", "quantization": "none"}, 0),
    "bf16-kernel": ({"dtype": "bfloat16", "quantization": "none"}, None),
    "int8-kernel": ({"dtype": "bfloat16", "quantization": "int8"}, None),
    "q4-kernel": ({"dtype": "bfloat16", "quantization": "q4"}, None),
}


@dataclass(slots=True)
class Generation:
    tokens: list[int]
    logprobs: list[float]  # of each chosen token
    top: list[list[int]]  # the TOP most likely ids at each position


def check_close(a: Generation, b: Generation) -> tuple[bool, int]:
    """vLLM's ``check_logprobs_close``: identical up to the first difference, where each side's
    token must be in the other's top list; returns (passes, first differing position)."""
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            return (x in b.top[i] and y in a.top[i]), i
    return True, min(len(a.tokens), len(b.tokens))


def reference(prompts: list[list[int]]) -> list[Generation]:
    """bf16 ``generate``, greedy, with each step's distribution."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model

    source = resolve_model("SmolLM2-135M-Instruct")
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.bfloat16).eval()
    out = []
    for ids in prompts:
        with torch.inference_mode():
            result = model.generate(
                torch.tensor([ids]),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                min_new_tokens=NEW_TOKENS,
            )
        tokens = result.sequences[0, len(ids) :].tolist()
        logps = [step[0].float().log_softmax(-1) for step in result.logits]
        out.append(
            Generation(
                tokens,
                [lp[t].item() for lp, t in zip(logps, tokens)],
                [lp.topk(TOP).indices.tolist() for lp in logps],
            )
        )
    return out


def run_engine(mode: str, prompts: list[list[int]]) -> list[Generation]:
    """The worker's engine in-process, one request at a time."""
    from common.model_source import resolve_model
    from common.protocol import NewRequest, SamplingParams
    from worker.build import build_engine
    from worker.config import WorkerConfig
    from worker.runner import paths

    fields, rows = MODES[mode]
    saved = paths.FAST_DECODE_MAX_ROWS
    paths.FAST_DECODE_MAX_ROWS = saved if rows is None else rows
    try:
        engine = build_engine(
            resolve_model("SmolLM2-135M-Instruct"),
            WorkerConfig(kv_cache_memory="256MiB", **fields),
        )
        out = []
        for i, ids in enumerate(prompts):
            params = SamplingParams(temperature=0, logprobs=TOP, min_tokens=NEW_TOKENS)
            engine.add_request(NewRequest(f"p{i}", ids, NEW_TOKENS, params))
            gen = Generation([], [], [])
            while engine.has_work():
                for o in engine.step().outputs:
                    gen.tokens.extend(o.new_token_ids)
                    for lp in o.logprobs or []:
                        gen.logprobs.append(lp.logprob)
                        gen.top.append(lp.top_ids)
            out.append(gen)
        return out
    finally:
        paths.FAST_DECODE_MAX_ROWS = saved


def chat_prompts() -> list[list[int]]:
    from common.config import CACHE_DIR
    from common.model_source import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model("SmolLM2-135M-Instruct"), CACHE_DIR.env_default())
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for p in PROMPTS
    ]


def compare(ref: list[Generation], got: list[Generation]) -> dict[str, float]:
    close = [check_close(r, g) for r, g in zip(ref, got)]
    diffs = [abs(a - b) for r, g, (_, n) in zip(ref, got, close) for a, b in zip(r.logprobs[:n], g.logprobs[:n])]
    return {
        "exact": sum(r.tokens == g.tokens for r, g in zip(ref, got)) / len(ref),
        "close": sum(ok for ok, _ in close) / len(ref),
        "diverge_at": sum(n for _, n in close) / len(ref),
        "mean_abs_dlogprob": sum(diffs) / max(1, len(diffs)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    args = parser.parse_args()
    prompts = chat_prompts()
    ref = reference(prompts)
    results = {mode: compare(ref, run_engine(mode, prompts)) for mode in args.modes.split(",")}
    print(f"{len(PROMPTS)} prompts, {NEW_TOKENS} greedy tokens each, against bf16 generate")
    print(f"{'mode':<12} {'exact':>6} {'close':>6} {'diverge@':>9} {'|dlogp|':>8}")
    for mode, r in results.items():
        print(
            f"{mode:<12} {r['exact']:>6.0%} {r['close']:>6.0%} {r['diverge_at']:>9.1f} {r['mean_abs_dlogprob']:>8.4f}"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
