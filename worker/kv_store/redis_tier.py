"""The store in Redis, for workers on several machines (``--kv-store redis://HOST:PORT/DB``).

One key per block, ``llmpool:kv:<fingerprint>:<key>``, holding the same record as a file would
(worker/kv_store/record.py), checked the same way. ``SET ... NX`` writes a block whole or not at all,
so many workers write without locks. Reads go in pipelined windows of READ_WINDOW blocks.

The size bound is the server's: run Redis with ``maxmemory`` and ``maxmemory-policy volatile-ttl``.
Each block's key expires ``IDLE_S`` after its last use, or after its retention ends when a request
asked for one (``Block.keep_until``: ``cache_control`` ttl, ``prompt_cache_retention``); each use
moves the expiry later, never earlier (``GT``). Under ``volatile-ttl`` Redis evicts the key whose
expiry comes first: the least recently used block, and a retained one only after every block used
before its retention ends, the order the folder store keeps by modification time. Under
``allkeys-lru`` eviction ignores retention (a worker warns at start). ``--kv-store-size`` bounds disk
stores only; a Redis without ``maxmemory`` is warned about at start. The size and evictions
reported are the server's (``used_memory``, ``evicted_keys``).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import redis

from worker.kv_store import record
from worker.kv_store.fingerprint import Fingerprint
from worker.kv_store.record import Buffer
from worker.kv_store.tier import Block, TierUsage

log = logging.getLogger(__name__)

PREFIX = "llmpool:kv:"
READ_WINDOW = 16
TIMEOUT_S = 5.0
IDLE_S = 7 * 86400  # a block nobody used (or retained) for a week expires, even with memory to spare


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S)


class RedisTier:
    """Blocks of one fingerprint in a Redis database that workers on many machines share."""

    def __init__(self, url: str, fingerprint: Fingerprint) -> None:
        self.client = connect(url)
        self.fingerprint = fingerprint.digest()
        self.prefix = f"{PREFIX}{fingerprint.hex}:".encode()
        self.description = f"redis {url.split('@')[-1]}"  # no password in logs
        self._usage = TierUsage()
        try:
            self.client.set(PREFIX + "store-id", uuid.uuid4().hex, nx=True)
            self.store_id = self.client.get(PREFIX + "store-id").decode()
            self.client.set(f"{PREFIX}{fingerprint.hex}", json.dumps(fingerprint.describe(), indent=2), nx=True)
            memory = self.client.info("memory")  # INFO, not CONFIG: managed Redis often refuses CONFIG
        except redis.RedisError as exc:
            raise ValueError(f"--kv-store {self.description}: {type(exc).__name__}: {exc}") from None
        if not int(memory.get("maxmemory", 0) or 0):
            log.warning(
                "KV store: the Redis server has no maxmemory: nothing bounds the store's size (set maxmemory and volatile-ttl)"
            )
        elif memory.get("maxmemory_policy") != "volatile-ttl":
            log.warning(
                "KV store: the Redis server evicts by %s: retained blocks (cache_control ttl, prompt_cache_retention) "
                "go like others; set maxmemory-policy volatile-ttl",
                memory.get("maxmemory_policy"),
            )

    def _key(self, block: Block) -> bytes:
        return self.prefix + block.key.hex().encode()

    def count_run(self, blocks: Sequence[Block]) -> int:
        for start in range(0, len(blocks), READ_WINDOW):
            window = blocks[start : start + READ_WINDOW]
            pipe = self.client.pipeline(transaction=False)
            for block in window:
                pipe.exists(self._key(block))
            for index, present in enumerate(pipe.execute()):
                if not present:
                    return start + index
        return len(blocks)

    def read_run(self, blocks: Sequence[Block], slot: Callable[[int], memoryview]) -> int:
        for start in range(0, len(blocks), READ_WINDOW):
            window = blocks[start : start + READ_WINDOW]
            for index, data in enumerate(self.client.mget([self._key(b) for b in window])):
                if data is None or not self._unpack(window[index], data, slot(start + index)):
                    return start + index
        return len(blocks)

    def _unpack(self, block: Block, data: bytes, into: memoryview) -> bool:
        crc = record.check_header(data, self.fingerprint, block.key, block.tokens, into.nbytes)
        start = record.record_bytes(block.tokens)
        if crc is None or len(data) != start + into.nbytes:
            log.warning("KV store: a damaged record under %s; ignored and removed", self._key(block))
            self.client.delete(self._key(block))
            return False
        into[:] = memoryview(data)[start:]
        if record.checksum([block.tokens, into]) != crc:
            log.warning("KV store: a damaged record under %s; ignored and removed", self._key(block))
            self.client.delete(self._key(block))
            return False
        return True

    def ensure(self, block: Block, payload: Sequence[Buffer]) -> int:
        key = self._key(block)
        expires_ms = int((max(time.time(), block.keep_until) + IDLE_S) * 1000)  # its last use, or retention's end
        pipe = self.client.pipeline(transaction=False)
        pipe.touch(key)
        pipe.pexpireat(key, expires_ms, gt=True)  # later, never earlier: a plain use keeps a retention
        if pipe.execute()[0]:
            return 0
        data = b"".join([record.header(self.fingerprint, block.key, block.tokens, payload), *payload])
        return len(data) if self.client.set(key, data, nx=True, pxat=expires_ms) else 0

    def maintain(self) -> None:
        info = self.client.info()  # memory and stats
        self._usage.size_bytes = int(info.get("used_memory", 0))
        self._usage.evictions = int(info.get("evicted_keys", 0))

    @property
    def usage(self) -> TierUsage:
        return self._usage
