"""Responses running on this gateway whose events are logged: streamed or background ones.

A ``Run`` drives its events (each already encoded, with its sequence number) into the store's event
log and into memory, where any number of clients follow it: the one that created it, and any that
reconnect with ``starting_after``. When it ends, its final row is committed before the last event
goes out, so whoever reads that event finds the response stored. A run that another gateway started
and lost (it died) is continued here from its log (``take_over`` in gateway/http/routes/responses.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import msgspec

from gateway.state.records import ResponseRecord
from gateway.state.writer import Writer

log = logging.getLogger(__name__)
_decode_str = msgspec.json.Decoder(str).decode

# An event of another dialect's stream (chat, completions, Messages): its data is its SSE frame as a
# JSON string (the log keeps one event a line: the frame's own newlines are escaped).
FRAME = "frame"
STREAM_END = "stream.end"  # after such a stream's last frame: nothing goes out, its final row is committed
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed", STREAM_END)


@dataclass(slots=True)
class Event:
    """One event of a stream: its type, number, and the whole event as JSON (a Responses event) or
    as its SSE frame (``FRAME``: another dialect's)."""

    type: str
    seq: int
    data: bytes

    @property
    def terminal(self) -> bool:
        return self.type in TERMINAL_EVENTS

    def sse(self, stream: str) -> bytes:
        """As a server-sent event whose ``id:`` names its stream and number (what ``Last-Event-ID`` resumes after)."""
        if self.type == STREAM_END:
            return b""
        head = b"id: %s/%d\n" % (stream.encode(), self.seq)
        if self.type == FRAME:
            return head + _decode_str(self.data).encode()
        return head + b"event: " + self.type.encode() + b"\ndata: " + self.data + b"\n\n"


# The final row as the route builds it, from the state its events left (status: how it ended).
Finisher = Callable[[str], ResponseRecord]
# What else happens once the final row is committed (a conversation gets the response's items).
AfterFinal = Callable[[], Awaitable[None]]


class Run:
    def __init__(
        self,
        response_id: str,
        background: bool,
        writer: Writer,
        finisher: Finisher,
        logged: list[Event] | None = None,
        after: AfterFinal | None = None,
    ) -> None:
        self.id = response_id
        self.after = after
        self.background = background
        self.writer = writer
        self.finisher = finisher
        self.events: list[Event] = list(logged or [])
        self.logged = len(self.events) - 1  # events already in the log (a run taken over)
        self.done = False
        self.cancel_requested = False
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._bytes = sum(len(e.data) for e in self.events)

    def chunk(self, seq: int, data: bytes) -> None:
        """A token chunk behind the next events: what a gateway taking this run over replays."""
        self.writer.chunk(self.id, seq, data)

    async def drive(self, source: AsyncIterator[Event]) -> None:
        try:
            async for event in source:
                if event.seq <= self.logged:
                    continue  # replayed after a takeover: it went out (and into the log) before
                self.writer.event(self.id, event.seq, event.data)
                self._bytes += len(event.data)
                if event.terminal:
                    await self._final(event.type.removeprefix("response."))
                self._publish(event)
        except asyncio.CancelledError:
            if self.cancel_requested:  # POST /cancel: the response is kept, as cancelled
                await self._final("cancelled")
            elif not self.background:  # the client of a plain stream left: nothing is stored, as before
                self.writer.drop(self.id)
            raise
        except Exception:
            log.exception("response %s failed while running", self.id)
            raise
        finally:
            self.done = True
            self._changed.set()

    async def _final(self, status: str) -> None:
        record = self.finisher(status)
        record.extra_bytes = self._bytes
        try:
            await self.writer.final(record)
            if self.after is not None:
                await self.after()
        except Exception as exc:  # the client still gets its answer; the store says why it lacks it
            log.error("response %s could not be stored: %s", self.id, exc)

    def _publish(self, event: Event) -> None:
        self.events.append(event)
        self._changed.set()

    async def follow(self, after: int = -1) -> AsyncIterator[Event]:
        """Events numbered above ``after``, as they come, until the run ends."""
        index = after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            self._changed.clear()
            if index < len(self.events) or self.done:
                continue
            await self._changed.wait()


class Runs:
    """This gateway's runs by response id."""

    def __init__(self) -> None:
        self.running: dict[str, Run] = {}

    def start(self, run: Run, source: AsyncIterator[Event]) -> Run:
        async def main() -> None:
            try:
                await run.drive(source)
            finally:
                self.running.pop(run.id, None)

        self.running[run.id] = run
        run.task = asyncio.create_task(main(), name=f"response-{run.id}")
        run.task.add_done_callback(_retrieve)
        return run

    def get(self, response_id: str) -> Run | None:
        return self.running.get(response_id)

    def cancel(self, response_id: str, requested: bool = True) -> bool:
        run = self.running.get(response_id)
        if run is None or run.task is None or run.task.done():
            return False
        run.cancel_requested = requested
        run.task.cancel()
        return True

    async def stop(self) -> None:
        """At shutdown: background runs stay in progress in the store, for another gateway to take over."""
        tasks = [run.task for run in self.running.values() if run.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def wait(self, response_id: str) -> None:
        run = self.running.get(response_id)
        if run is not None and run.task is not None:
            await asyncio.shield(run.task)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: a failure was logged by the run itself
