"""The interface every place that keeps KV blocks offers (a folder, Redis; on a GPU, host RAM first).

A tier stores records (worker/kv_store/record.py) by key and knows nothing of requests or tensors.
``read_run`` reads consecutive blocks of one prompt until the first one it lacks or cannot trust;
``ensure`` stores a block unless it is there already (then it counts as used, for LRU eviction).
Both run on the store's own threads (worker/kv_store/link.py), never on the engine's.

A GPU worker would put a host-RAM tier in front of the disk (KV offload: a block evicted from GPU
memory is copied to pinned host memory, and spills to disk from there): the same interface, chained,
with the runner's block I/O (worker/runner/kv_blocks.py) doing the device copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from worker.kv_store.record import Buffer


@dataclass(slots=True)
class Block:
    """One block to read or write: its key and token ids (as record bytes)."""

    key: bytes
    tokens: bytes
    keep_until: float = 0.0  # wall-clock time it is retained until (a ttl asked for): evicted after others


@dataclass(slots=True)
class TierUsage:
    """What the tier holds, as last measured (the folder's size is scanned now and then)."""

    size_bytes: int = 0
    evictions: int = 0  # blocks this worker evicted (Redis: keys the server evicted)


class Tier(Protocol):
    store_id: str  # equal ids: the same blocks (one shared folder, one Redis), whoever wrote them
    description: str

    def read_run(self, blocks: Sequence[Block], slot: Callable[[int], memoryview]) -> int:
        """Read ``blocks`` in order into ``slot(i)`` (one payload each); how many were read and
        passed their checks before the first that did not."""
        ...

    def count_run(self, blocks: Sequence[Block]) -> int:
        """How many of ``blocks``, from the first, the tier has (cheap: no payloads read)."""
        ...

    def ensure(self, block: Block, payload: Sequence[Buffer]) -> int:
        """Store the block unless it is there (then mark it used); the bytes written (0 if not).
        A block with ``keep_until`` is evicted after unretained ones until then."""
        ...

    def maintain(self) -> None:
        """Keep the size bound (evict the least recently used) and refresh ``usage``; called by the
        writer thread between writes."""
        ...

    @property
    def usage(self) -> TierUsage: ...
