"""The admission queue, fair between API keys: one queue per key (a key's owner digest; '' for an
open server or a ``--api-key`` one, which is then one first-come queue as before).

- **Who goes next:** the most urgent head (``priority``, lower first: each key's queue is kept in
  priority order), then the head of the key that holds the fewest slots now (ties: the earlier
  head), so a key with nothing running goes ahead of one with a hundred requests running or queued.
- **Who is refused when the queue is full:** the newest waiter of the key that queues the most, if
  that key queues more than the newcomer's does (it is "pushed out": a 429 before its response
  starts, as any refusal); otherwise the newcomer. One key's burst thus fills only what other keys
  leave free, and never takes a place another key's request holds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol


class Waiter(Protocol):
    key: str
    seq: int
    priority: int


class FairQueue:
    def __init__(self) -> None:
        self._keys: dict[str, deque] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, waiter: Waiter) -> bool:
        return waiter in self._keys.get(waiter.key, ())

    def count(self, key: str) -> int:
        queue = self._keys.get(key)
        return len(queue) if queue else 0

    def append(self, waiter: Waiter) -> None:
        """Behind the key's waiters at least as urgent, ahead of the less urgent."""
        queue = self._keys.setdefault(waiter.key, deque())
        if not queue or queue[-1].priority <= waiter.priority:
            queue.append(waiter)
        else:
            queue.insert(next(i for i, w in enumerate(queue) if w.priority > waiter.priority), waiter)
        self._size += 1

    def remove(self, waiter: Waiter) -> None:
        queue = self._keys[waiter.key]
        queue.remove(waiter)
        self._size -= 1
        if not queue:
            del self._keys[waiter.key]

    def head(self, held: Callable[[str], int]) -> Waiter | None:
        """The waiter that goes next: the most urgent, then the one whose key holds the fewest slots
        (``held``), then the earliest."""
        best = None
        for key, queue in self._keys.items():
            rank = (queue[0].priority, held(key), queue[0].seq)
            if best is None or rank < best[0]:
                best = (rank, queue[0])
        return None if best is None else best[1]

    def busiest(self) -> Waiter | None:
        """The last waiter (the least urgent, then the newest) of the key that queues the most: the
        first to go when room is needed."""
        if not self._keys:
            return None
        queue = max(self._keys.values(), key=len)
        return queue[-1]
