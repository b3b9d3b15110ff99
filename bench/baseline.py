"""The baseline: transformers' ``generate``, one request at a time, on the same prompts and dtype."""

from __future__ import annotations

import time

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LogitsProcessor,
    LogitsProcessorList,
)

from bench.load import RequestTiming
from common.model_source import resolve_model


class _Clock(LogitsProcessor):
    """Called once per generated token: records when each token's logits were ready."""

    def __init__(self, timing: RequestTiming) -> None:
        self.timing = timing

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        now = time.perf_counter()
        self.timing.first_token = self.timing.first_token or now
        self.timing.chunk_times.append(now)
        return scores


def run_baseline(
    model_spec: str, prompts: list[str], requests: int, max_tokens: int
) -> tuple[list[RequestTiming], float]:
    source = resolve_model(model_spec)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.bfloat16).eval()
    timings = []
    start = time.perf_counter()
    for i in range(requests):
        messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        timing = RequestTiming(start=time.perf_counter(), prompt_tokens=len(ids))
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=True,
                temperature=0.8,
                logits_processor=LogitsProcessorList([_Clock(timing)]),
            )
        timing.end = time.perf_counter()
        timing.completion_tokens = out.shape[1] - len(ids)
        timings.append(timing)
    return timings, time.perf_counter() - start
