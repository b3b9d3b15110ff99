"""Backpressure: at most ``max_concurrent`` requests at the workers and ``max_waiting`` queued for a
slot; past both a request is refused at once with 429 and Retry-After, never after a timeout.

Routes take the slot before they answer (so a refusal is a real 429, not an error inside a 200
stream) and hand it to the generation, which releases it when it ends, however it ends.
"""

from __future__ import annotations

import asyncio

from gateway.errors import Overloaded


class Slot:
    """One admitted request's place; released exactly once, at the latest when it is collected."""

    def __init__(self, semaphore: asyncio.Semaphore) -> None:
        self._semaphore = semaphore
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._semaphore.release()

    def __del__(self) -> None:  # a response that was never iterated must not leak its slot
        self.release()


class Admission:
    def __init__(self, max_concurrent: int, max_waiting: int) -> None:
        self.max_concurrent = max_concurrent
        self.max_waiting = max_waiting
        self._slots = asyncio.Semaphore(max_concurrent)
        self.waiting = 0
        self.rejected = 0

    async def acquire(self) -> Slot:
        """A slot now, or after queueing behind others; Overloaded at once when the queue is full too."""
        if self._slots.locked():
            if self.waiting >= self.max_waiting:
                self.rejected += 1
                raise Overloaded(
                    f"the server is at capacity ({self.max_concurrent} requests running, {self.waiting} waiting); retry shortly",
                    code="server_overloaded",
                )
            self.waiting += 1
            try:
                await self._slots.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        return Slot(self._slots)
