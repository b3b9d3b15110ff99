"""Results that do not depend on load (issue 39): on the default path (the GGUF on the CPU, every batch
through the C++ step) a seeded request gives the same tokens, and the same logprobs to the bit,
whatever the thread count (the worker shrinks its team while a core is taken), the batch it lands
in, how its prompt is chunked and whether its prefix came from the cache. The step's integer sums
are exact, its float sums run per row in one order, and its attention splits a row's context by
the row's own length."""

import pytest
import torch

from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from tests.worker.factories import drain
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine

PROMPT = [(i * 7919) % 40000 + 100 for i in range(300)]  # past 256 positions: its decode splits the context
SEEDED = SamplingParams(temperature=1.0, seed=1234, logprobs=2)


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = build_engine(resolve_model("SmolLM2-135M-Instruct"), WorkerConfig(kv_cache_memory="64MiB"))
    assert engine.runner.paths.rows_only  # the default: every batch through the C++ step
    return engine


def answer(
    engine: Engine, name: str, others: int = 0, threads: int = 2, budget: int | None = None, cached: bool = False
):
    """The seeded request's tokens and logprobs, beside ``others`` requests of other lengths."""
    engine.blocks.enable_prefix_caching = cached
    saved = engine.scheduler.max_num_batched_tokens, engine.scheduler.max_prefill_chunk, torch.get_num_threads()
    if budget:
        engine.scheduler.max_num_batched_tokens = engine.scheduler.max_prefill_chunk = budget
    torch.set_num_threads(threads)
    try:
        news = [NewRequest(name, PROMPT, 24, SEEDED)]
        news += [
            NewRequest(f"{name}-{i}", PROMPT[i : i + 40 + 70 * i], 16 + i, SamplingParams(temperature=1.0, seed=i))
            for i in range(others)
        ]
        out = drain(engine, news)[name]
    finally:
        engine.scheduler.max_num_batched_tokens, engine.scheduler.max_prefill_chunk, threads = saved
        torch.set_num_threads(threads)
    return [t for o in out for t in o.new_token_ids], [(lp.logprob, lp.top_logprobs) for o in out for lp in o.logprobs]


def test_a_seeded_answer_is_the_same_whatever_the_threads_the_batch_the_chunks_and_the_cache(engine):
    alone = answer(engine, "alone")
    assert answer(engine, "one-thread", threads=1) == alone
    assert answer(engine, "three-threads", threads=3) == alone
    assert answer(engine, "in-a-batch", others=6) == alone  # 7 rows: at 2 threads each row's context was once unsplit
    assert answer(engine, "in-a-batch-one-thread", others=6, threads=1) == alone
    assert answer(engine, "chunked", budget=48) == alone  # the prompt in chunks of 48 beside the others' rows
    answer(engine, "warm", cached=True)
    hits = engine.blocks.hit_tokens
    assert answer(engine, "from-the-cache", cached=True, others=2) == alone
    assert engine.blocks.hit_tokens - hits >= 256  # its prefix really came from the cache
