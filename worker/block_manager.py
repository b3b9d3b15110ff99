"""Paged KV-cache bookkeeping with automatic prefix caching, and no tensors in sight.

The model runner owns the KV tensors, shaped ``[num_blocks, block_size, ...]``; this module only
decides which block ids a request's tokens live in. Admission asks it for room before a request
runs, so the cache can never be over-committed.

Prefix caching: once a block is full of computed tokens it gets a hash chained from its parent's
(so equal hashes mean equal whole prefixes) and is registered. A new request first looks its
prompt up block by block and shares every block that matches (reference counts), computing only
the rest. A block whose last user is done goes to the back of an LRU free list but keeps its
contents and hash until it is taken for other tokens, so a later request with the same prefix
(a shared system prompt, the next turn of a conversation) still finds it.

Retention (Anthropic's ``cache_control`` ttl, OpenAI's ``prompt_cache_retention``): a request with
``retain_s`` keeps the blocks it computes or reuses until ``retain_s`` from now (each use renews it,
as Anthropic's ttl is renewed by a hit). Such a block, once free, waits in a second free list that
is used only when no ordinary free block is left, the one whose retention ends first going first.
When its retention ends it joins the front of the ordinary LRU list (the next to go).
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from worker.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()  # the tokens behind the hash, checked on lookup (no false sharing)
    keep_until: float = 0.0  # retained (clock time) for a request that asked to keep it: evicted after others


def chain_hash(parent: int | str | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    """Hands out blocks, shares cached prefix blocks, and takes them back (reverse order, LRU)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._kept: dict[int, float] = {}  # free retained blocks (id -> until): reused only once _free is empty
        self._kept_order: list[tuple[float, int]] = []  # a heap of (until, id); stale entries are skipped
        self.clock = clock
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self.queried_tokens = 0  # prompt tokens looked up
        # Told of each block the cache registers and drops (worker/kv_events.py's publisher), when set.
        self.events: Any = None

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._kept)

    def _next_free(self) -> int:
        """The block to reuse: the least recently freed unretained one, else the retained one whose
        retention ends first. Retentions that ended move to the front of the LRU list first."""
        self._expire()
        if self._free:
            return next(iter(self._free))
        return self._kept_order[0][1]

    def _expire(self) -> None:
        """Free retained blocks whose time is up become ordinary, next in line; stale heap entries go."""
        order, now = self._kept_order, self.clock()
        while order and (self._kept.get(order[0][1]) != order[0][0] or order[0][0] <= now):
            until, block_id = heapq.heappop(order)
            if self._kept.get(block_id) == until:
                del self._kept[block_id]
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    def _retain(self, block: Block, request: Request) -> None:
        """A retaining request uses the block: it is kept until ``retain_s`` from now (renewed)."""
        if request.retain_s > 0:
            block.keep_until = max(block.keep_until, self.clock() + request.retain_s)

    @property
    def num_retained_blocks(self) -> int:
        """Cached blocks still under a retention (in use or free)."""
        now = self.clock()
        return sum(1 for b in self.blocks if b.block_hash is not None and b.keep_until > now)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def match_prefix(self, request: Request) -> int:
        """Share the cached blocks of a new request's leading full blocks; returns tokens reused.

        At least one token is always left to compute, so the step still produces logits. A request
        that wants its prompt's logprobs needs logits at every prompt position, so it reuses nothing.
        """
        if not self.enable_prefix_caching or request.block_ids or request.sampling.prompt_logprobs is not None:
            return 0
        self.queried_tokens += request.num_tokens
        for block_id, block_hash in self._cached_run(request):
            self._take(block_id)
            self._retain(self.blocks[block_id], request)
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
        reused = len(request.block_ids) * self.block_size
        request.num_computed_tokens = reused
        self.hit_tokens += reused
        return reused

    def cached_prefix_blocks(self, request: Request) -> int:
        """How many leading blocks ``match_prefix`` would share now (nothing is taken)."""
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return 0
        return sum(1 for _ in self._cached_run(request))

    def _cached_run(self, request: Request) -> Iterator[tuple[int, int]]:
        """(block id, hash) of the prompt's leading blocks that are cached, all but its last token."""
        size = self.block_size
        parent: int | str | None = request.cache_salt
        tokens = request.token_ids
        for index in range((len(tokens) - 1) // size):
            chunk = request.block_key(index, size)
            block_hash = chain_hash(parent, chunk)
            block_id = self._cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != chunk:
                return
            yield block_id, block_hash
            parent = block_hash

    def adopt(self, request: Request, num_blocks: int) -> list[int]:
        """Give a request up to ``num_blocks`` more blocks (as many as are free) whose contents the
        caller fills from elsewhere (the KV store), counted as computed and registered like computed
        ones; returns their ids. The request's blocks so far must all be full and computed."""
        size = self.block_size
        taken: list[int] = []
        for _ in range(min(num_blocks, self.num_free_blocks)):
            block_id = self._next_free()
            self._forget(block_id)
            self._take(block_id)
            request.block_ids.append(block_id)
            taken.append(block_id)
        request.num_computed_tokens = len(request.block_ids) * size
        self.register_full_blocks(request)
        return taken

    def pin(self, block_id: int) -> None:
        """Hold a block that is in use, so it is not reused until ``unpin`` (the store's writer reads it)."""
        self._take(block_id)

    def unpin(self, block_id: int) -> None:
        self._drop(block_id)

    def _drop(self, block_id: int) -> None:
        """One reference less; the last one puts the block at the back of the LRU free list."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.keep_until > self.clock():
                self._kept[block_id] = block.keep_until
                heapq.heappush(self._kept_order, (block.keep_until, block_id))
                if len(self._kept_order) > 2 * len(self._kept) + 64:  # stale entries of blocks taken again
                    self._kept_order = [(until, i) for i, until in self._kept.items()]
                    heapq.heapify(self._kept_order)
            else:
                self._free[block_id] = None

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if it can't."""
        needed = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            block_id = self._next_free()  # least recently freed
            self._forget(block_id)
            self._take(block_id)
            request.block_ids.append(block_id)
        return True

    def register_full_blocks(self, request: Request) -> None:
        """After a step: hash the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        full = request.num_computed_tokens // size
        for index in range(len(request.block_hashes), full):
            parent = request.block_hashes[-1] if request.block_hashes else request.cache_salt
            chunk = request.block_key(index, size)
            block_hash = chain_hash(parent, chunk)
            request.block_hashes.append(block_hash)
            block = self.blocks[request.block_ids[index]]
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash, block.token_ids = block_hash, chunk
                if index < request.num_prompt_tokens // size:  # the prompt's blocks, not the answer's
                    self._retain(block, request)
                self._cached[block_hash] = block.block_id
                if self.events is not None:
                    self.events.stored(block_hash, parent if index else None, chunk, size, request.cache_salt)

    def free(self, request: Request) -> None:
        """Drop the request's references, last block first, so prefixes outlive their tails in the LRU."""
        for block_id in reversed(request.block_ids):
            self._drop(block_id)
        request.block_ids.clear()
        request.block_hashes.clear()

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            if self._kept.pop(block_id, None) is None:  # its heap entry goes stale
                del self._free[block_id]
        block.ref_count += 1

    def _forget(self, block_id: int) -> None:
        """A free block is about to hold other tokens: its cached contents are gone."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) == block_id:
                del self._cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash, block.token_ids, block.keep_until = None, (), 0.0
