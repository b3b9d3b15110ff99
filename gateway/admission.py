"""Backpressure: at most ``max_concurrent`` generations at the workers and ``max_waiting`` requests
queued for slots; past both a request is refused at once with 429 and Retry-After.

A request asks for all its slots at once (one per prompt and choice: ``n``, ``best_of``, prompt
lists) and gets all of them or none. Requests that held part of what they needed while waiting for
the rest once waited on each other forever, and with them every request after. Waiters are served
first come, first served, so a big request is never starved by a stream of small ones: while the
head of the queue waits for its slots, nobody behind it jumps ahead. Priority (gateway/priority.py:
lower is more urgent) orders the queue first: a waiter goes behind those at least as urgent.

Routes take the slots before they answer (so a refusal is a real 429, not an error inside a 200
stream) and hand them to the generation, which releases each when its choice ends, however it ends.

Liveness rule (``stalled``): while requests wait, some slot must be granted or released at least
every ``stall_s`` seconds; otherwise admission has stopped making progress and /ready says 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from gateway.errors import InvalidRequest, Overloaded


class Slot:
    """One admitted generation's place; released exactly once, at the latest when it is collected."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._give_back(1)

    def __del__(self) -> None:  # a response that was never iterated must not leak its slot
        self.release()


@dataclass(slots=True)
class _Waiter:
    count: int
    granted: asyncio.Future
    priority: int = 0


class Admission:
    def __init__(self, max_concurrent: int, max_waiting: int, stall_s: float = 60.0) -> None:
        self.max_concurrent = max_concurrent
        self.max_waiting = max_waiting
        self.stall_s = stall_s
        self.free = max_concurrent
        self.rejected = 0
        self._queue: deque[_Waiter] = deque()
        self._progress = time.monotonic()  # the last grant or release

    @property
    def waiting(self) -> int:
        """Requests queued for their slots."""
        return len(self._queue)

    @property
    def in_use(self) -> int:
        return self.max_concurrent - self.free

    def stalled(self) -> bool:
        """Requests wait, yet no slot was granted or released for ``stall_s`` seconds."""
        return bool(self._queue) and time.monotonic() - self._progress > self.stall_s

    def check_fits(self, count: int, param: str, what: str) -> None:
        """A request that could never be admitted is a 400 now, not a wait that never ends."""
        if count > self.max_concurrent:
            raise InvalidRequest(
                f"{what} asks for {count} generations at once, more than this server runs at a time "
                f"(--max-concurrent-requests {self.max_concurrent}); lower `{param}` or split the request",
                param=param,
            )

    async def acquire(self, count: int = 1, priority: int = 0) -> list[Slot]:
        """``count`` slots together, now or after queueing behind earlier requests (of this or a more
        urgent ``priority``); Overloaded at once when the queue is full. Cancelling the wait
        (timeout, client gone) takes nothing."""
        if count > self.max_concurrent:
            raise ValueError(f"{count} slots can never be had (check_fits refuses such requests)")
        if not self._queue and self.free >= count:
            return self._grant(count)
        if len(self._queue) >= self.max_waiting:
            self.rejected += 1
            raise Overloaded(
                f"the server is at capacity ({self.in_use} generations running, {self.waiting} requests waiting); retry shortly",
                code="server_overloaded",
            )
        waiter = _Waiter(count, asyncio.get_running_loop().create_future(), priority)
        if not self._queue or self._queue[-1].priority <= priority:
            self._queue.append(waiter)
        else:  # ahead of the less urgent: it may be the head now, and fit
            self._queue.insert(next(i for i, w in enumerate(self._queue) if w.priority > priority), waiter)
            self._wake()
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                for slot in waiter.granted.result():  # granted as the wait was cancelled: give them back
                    slot.release()
            elif waiter in self._queue:
                self._queue.remove(waiter)
                self._wake()  # the head may have changed
            raise

    def _grant(self, count: int) -> list[Slot]:
        self.free -= count
        self._progress = time.monotonic()
        return [Slot(self) for _ in range(count)]

    def _give_back(self, count: int) -> None:
        self.free += count
        self._progress = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        """Grant queued requests in order while the head's slots are free."""
        while self._queue and self._queue[0].count <= self.free:
            waiter = self._queue.popleft()
            if not waiter.granted.done():
                waiter.granted.set_result(self._grant(waiter.count))
