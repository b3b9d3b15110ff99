"""The KV store with the real model in float32: greedy output from stored blocks equals the output
computed from scratch, token for token (and that equals transformers' ``generate``: test_engine.py),
on a second worker beside the one that wrote them, after a restart, with blocks written by the other
model implementation (other kernels, same dtype), through Redis, and with a damaged record in the
way. A worker with another fingerprint reads nothing."""

from __future__ import annotations

import random

from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.kv_store.record import chain_keys

MODEL = resolve_model("SmolLM2-135M-Instruct")
NEW_TOKENS = 6
_rng = random.Random(29)
SHARED = [_rng.randrange(200, 40000) for _ in range(70)]  # a system prompt: 4 full blocks of 16
PROMPTS = [
    SHARED + [_rng.randrange(200, 40000) for _ in range(20)],
    SHARED + [_rng.randrange(200, 40000) for _ in range(30)],
]
# Blocks worth loading (all but each prompt's last token): 5 and 6; the second shares 4 of its 6
# with the first, which the prefix cache serves once the first has them.
LOADED_BLOCKS = 5 + 2


def engine(store: str, **settings: object) -> Engine:
    return build_engine(MODEL, WorkerConfig(dtype="float32", kv_store=store, kv_cache_memory="32MiB", **settings))


def run(engine: Engine) -> list[list[int]]:
    """Both prompts at once, greedy, to the end; then the store's writes, and no block leaked."""
    for i, ids in enumerate(PROMPTS):
        engine.add_request(NewRequest(f"r{i}", ids, NEW_TOKENS, SamplingParams(temperature=0)))
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.kv_store.flush()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, "KV blocks leaked"
    return [out[f"r{i}"] for i in range(len(PROMPTS))]


def test_stored_blocks_give_the_exact_output_on_a_second_worker_and_after_a_restart(tmp_path):
    writer = engine(str(tmp_path), model_impl="transformers")  # transformers' classes and SDPA write the blocks
    from_scratch = run(writer)
    assert writer.load().kv_store_hits == 0 and writer.load().kv_store_written_bytes > 0

    second = engine(
        str(tmp_path), model_impl="native"
    )  # a second worker, beside the first: the native forward reads them
    assert run(second) == from_scratch
    load = second.load()
    assert (load.kv_store_hits, load.kv_store_misses, load.kv_store_written_bytes) == (LOADED_BLOCKS, 0, 0)
    assert load.kv_store_id == writer.load().kv_store_id
    del second

    # A restart, with one record damaged meanwhile (a torn write, a bad disk): the blocks before it
    # are loaded, it and those after it are computed, and it is written again.
    damaged = writer.kv_store.tier.path(chain_keys(writer.kv_store.fingerprint, PROMPTS[0], 16, 4)[3])
    damaged.write_bytes(damaged.read_bytes()[:-100])
    restarted = engine(str(tmp_path), model_impl="native")
    assert run(restarted) == from_scratch
    load = restarted.load()
    # r0: 3 of 5 loaded, 2 missed; r1: those 3 from the prefix cache, and 3 missed, or 2 when r0 had
    # computed their shared fourth block by the time r1 was looked up (the two race in one engine).
    assert load.kv_store_hits == 3 and load.kv_store_misses in (2 + 2, 2 + 3), load
    assert damaged.is_file() and load.kv_store_written_bytes > 0
    del restarted

    other = engine(str(tmp_path), block_size=8)  # another KV layout: another fingerprint, never read
    assert run(other) == from_scratch
    load = other.load()
    assert (load.kv_store_hits, load.kv_store_read_bytes) == (0, 0) and load.kv_store_misses > 0
    assert load.kv_store_id != writer.load().kv_store_id


def test_workers_share_blocks_through_redis(redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    from_scratch = run(engine(redis_url))
    other = engine(redis_url)  # as if on another machine: nothing shared but Redis
    assert run(other) == from_scratch
    assert (other.load().kv_store_hits, other.load().kv_store_misses) == (LOADED_BLOCKS, 0)
