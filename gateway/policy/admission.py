"""Backpressure: at most ``max_concurrent`` generations at the workers and ``max_waiting`` requests
queued for slots; past both a request is refused at once with 429 and Retry-After.

A request asks for all its slots at once (one per prompt and choice: ``n``, ``best_of``, prompt
lists) and gets all of them or none. Requests that held part of what they needed while waiting for
the rest once waited on each other forever, and with them every request after. Waiters are served
first come, first served, so a big request is never starved by a stream of small ones: while the
head of the queue waits for its slots, nobody behind it jumps ahead. Between API keys the queue is
fair (gateway/policy/fair_queue.py): the key holding the fewest slots goes first, and a full queue refuses
the burst of the key that queues the most, not a newcomer of another key.
Priority (gateway/policy/priority.py: lower is more urgent) comes before both: a waiter goes behind those
at least as urgent.

Routes take the slots before they answer (so a refusal is a real 429, not an error inside a 200
stream) and hand them to the generation, which releases each when its choice ends, however it ends.

Liveness rule (``stalled``): while requests wait, some slot must be granted or released at least
every ``stall_s`` seconds; otherwise admission has stopped making progress and /ready says 503.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from dataclasses import dataclass

from gateway.errors import InvalidRequest, Overloaded
from gateway.policy.fair_queue import FairQueue


class Slot:
    """One admitted generation's place; released exactly once, at the latest when it is collected."""

    def __init__(self, admission: Admission, key: str = "") -> None:
        self._admission = admission
        self._held = True
        self.key = key

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._give_back(1, self.key)

    def __del__(self) -> None:  # a response that was never iterated must not leak its slot
        self.release()


@dataclass(slots=True, eq=False)
class _Waiter:
    count: int
    granted: asyncio.Future
    key: str = ""  # whose request: the fair queue's unit (gateway/policy/fair_queue.py)
    seq: int = 0
    priority: int = 0


class Admission:
    def __init__(self, max_concurrent: int, max_waiting: int, stall_s: float = 60.0) -> None:
        self.max_concurrent = max_concurrent
        self.max_waiting = max_waiting
        self.stall_s = stall_s
        self.free = max_concurrent
        self.rejected = 0
        self.pushed_out = 0  # of the refused, those that waited and gave their place to another key's request
        self.held: Counter[str] = Counter()  # slots per key
        self._queue = FairQueue()
        self._seq = itertools.count()
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

    def queued(self, key: str) -> int:
        """Requests of ``key`` waiting for their slots."""
        return self._queue.count(key)

    async def acquire(self, count: int = 1, key: str = "", priority: int = 0) -> list[Slot]:
        """``count`` slots together, now or after queueing behind earlier requests (of this or a more
        urgent ``priority``); Overloaded at once when the queue is full (and no other key queues more
        than ``key``). Cancelling the wait (timeout, client gone) takes nothing."""
        if count > self.max_concurrent:
            raise ValueError(f"{count} slots can never be had (check_fits refuses such requests)")
        if not self._queue and self.free >= count:
            return self._grant(count, key)
        if len(self._queue) >= self.max_waiting:
            busiest = self._queue.busiest()
            if busiest is None or self._queue.count(busiest.key) <= self._queue.count(key) + 1:
                self.rejected += 1
                raise self._overloaded()
            self._queue.remove(busiest)  # a key that queues more gives its newest place to this one
            self.rejected += 1
            self.pushed_out += 1
            busiest.granted.set_exception(self._overloaded())
        waiter = _Waiter(count, asyncio.get_running_loop().create_future(), key, next(self._seq), priority)
        self._queue.append(waiter)
        self._wake()  # another key's head may be waiting for more slots than this one needs... or this is the head
        try:
            return await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled() and waiter.granted.exception() is None:
                for slot in waiter.granted.result():  # granted as the wait was cancelled: give them back
                    slot.release()
            elif waiter in self._queue:
                self._queue.remove(waiter)
                self._wake()  # the head may have changed
            raise

    def _overloaded(self) -> Overloaded:
        return Overloaded(
            f"the server is at capacity ({self.in_use} generations running, {self.waiting} requests waiting); retry shortly",
            code="server_overloaded",
        )

    def _grant(self, count: int, key: str) -> list[Slot]:
        self.free -= count
        self.held[key] += count
        self._progress = time.monotonic()
        return [Slot(self, key) for _ in range(count)]

    def _give_back(self, count: int, key: str) -> None:
        self.free += count
        self.held[key] -= count
        if not self.held[key]:
            del self.held[key]
        self._progress = time.monotonic()
        self._wake()

    def _wake(self) -> None:
        """Grant queued requests, the fair queue's head first, while the head's slots are free."""
        while (waiter := self._queue.head(self.held.__getitem__)) is not None and waiter.count <= self.free:
            self._queue.remove(waiter)
            if not waiter.granted.done():
                waiter.granted.set_result(self._grant(waiter.count, waiter.key))
