"""Paged KV-cache bookkeeping: fixed-size blocks handed to requests, with no tensors in sight.

The model runner owns the KV tensors, shaped ``[num_blocks, block_size, ...]``; this module only
decides which block ids a request's tokens live in. Admission asks it for room before a request
runs, so the cache can never be over-committed.
"""

from __future__ import annotations

from collections import deque

from worker.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """A free list of block ids; requests take blocks as their sequences grow and give all back at the end."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more computed tokens; False (and no change) if it can't."""
        needed = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            request.block_ids.append(self._free.popleft())
        return True

    def free(self, request: Request) -> None:
        """Give back all of a request's blocks, last first, so recently used blocks are reused last."""
        self._free.extend(reversed(request.block_ids))
        request.block_ids.clear()
