"""A second tier for KV blocks, under the prefix cache: it outlives the worker and is shared by the pool.

The prefix cache (worker/block_manager.py) keeps blocks only in one worker's memory. With
``--kv-store`` every full prompt block a worker computes is also written, behind the steps, to a
store that other workers (and this one after a restart) read instead of computing the prompt again.

    record.py       keys (chained over full blocks and their images' pixel digests, seeded by the fingerprint), the checked record
    fingerprint.py  what makes blocks valid for a worker: weights, config, dtype, layout, quantization
    tier.py         the interface of a place that keeps records (Tier)
    disk.py         a folder, shared by the processes that mount it (atomic renames, LRU by a size bound)
    redis_tier.py   Redis, for workers on several machines
    link.py         the engine's side: lookups as requests arrive, loads at admission, write-behind
    admin.py        ``llmpool kv-store stats|clear``

The runner's part (a block's bytes out of and into the paged cache, the weights' digest) is
worker/runner/kv_blocks.py.
"""

from __future__ import annotations

from worker.kv_store.fingerprint import Fingerprint
from worker.kv_store.link import KVStore
from worker.kv_store.tier import Tier


def open_tier(spec: str, fingerprint: Fingerprint, max_bytes: int) -> Tier:
    """``--kv-store``: a folder, or redis://HOST:PORT/DB (also rediss:// and unix://)."""
    if spec.startswith(("redis://", "rediss://", "unix://")):
        from worker.kv_store.redis_tier import RedisTier

        return RedisTier(spec, fingerprint)
    from worker.kv_store.disk import DiskTier

    return DiskTier(spec, fingerprint, max_bytes)


__all__ = ["Fingerprint", "KVStore", "Tier", "open_tier"]
