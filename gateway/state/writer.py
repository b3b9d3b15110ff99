"""The one writer of a gateway's stored responses and event logs: group commits off the token path.

Routes never wait on the database while tokens flow. They hand rows to ``Writer`` (a list append) and
go on; a background task commits whatever has gathered in one transaction: a running response's
first row, its events and token chunks as they go out, and the final row when it ends. Events alone
wait up to ``interval`` (``--state-log-interval``) to gather more, and each response's events (and chunks) of one commit go in
one row: 64 streams' deltas become one transaction of 64 rows, not thousands of rows. A final row
is committed at once, with that response's own pending events only (the others keep gathering: at
64 streams a response ends several times a second, and each end would otherwise write a row for
every stream), and its writer awaits that commit before the client is told the response is
complete, so a continuation on any gateway finds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from gateway.state.db import Database
from gateway.state.records import INSERT, UPSERT, ResponseRecord

log = logging.getLogger(__name__)
_list_encoder = msgspec.msgpack.Encoder()


def _grouped(rows: list[tuple[str, int, bytes]]) -> list[tuple[str, int, int, list[bytes]]]:
    """(response, seq, data) rows as one (response, first seq, last seq, datas) per response."""
    groups: dict[str, tuple[str, int, int, list[bytes]]] = {}
    for response_id, seq, data in rows:
        group = groups.get(response_id)
        if group is None:
            groups[response_id] = (response_id, seq, seq, [data])
        else:
            group[3].append(data)
            groups[response_id] = (response_id, group[1], seq, group[3])
    return list(groups.values())


@dataclass
class _Batch:
    starts: list[tuple] = field(default_factory=list)
    events: list[tuple] = field(default_factory=list)
    chunks: list[tuple] = field(default_factory=list)
    finals: list[ResponseRecord] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # runs that ended unstored: their log goes
    waiters: list[asyncio.Future] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.starts or self.events or self.chunks or self.finals or self.dropped or self.waiters)


class Writer:
    def __init__(self, db: Database, interval: float = 0.5) -> None:
        self.db = db
        self.interval = interval
        self._batch = _Batch()
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()  # a final row or a sync waits: commit now, not after the interval
        self._everything = False  # a sync waits: commit every pending row, not only the finals'
        self._task: asyncio.Task | None = None
        self.commits = 0  # transactions committed (the figures in docs/state.md come from these)
        self.rows = 0
        self.busy_s = 0.0  # time spent committing

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="state-writer")

    async def stop(self) -> None:
        """Commit what is pending, then stop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._batch:
            await self._commit(self._take(True))

    def started(self, record: ResponseRecord) -> None:
        """A response that runs (streamed or background) begins: its row, so any gateway can see it."""
        self._batch.starts.append(record.row(time.time()))
        self._wake.set()

    def event(self, response_id: str, seq: int, data: bytes) -> None:
        self._batch.events.append((response_id, seq, data))
        self._wake.set()

    def chunk(self, response_id: str, seq: int, data: bytes) -> None:
        self._batch.chunks.append((response_id, seq, data))
        self._wake.set()

    def drop(self, response_id: str) -> None:
        """A run that ends without being stored (its client left a stream that was not background)."""
        self._batch.dropped.append(response_id)
        self._wake.set()

    async def sync(self) -> None:
        """Returns once everything handed over so far is committed (a background response's first
        row, before its id goes out: any gateway can be asked about it next)."""
        waiter = asyncio.get_running_loop().create_future()
        self._batch.waiters.append(waiter)
        self._everything = True
        self._wake.set()
        self._urgent.set()
        await waiter

    async def final(self, record: ResponseRecord) -> None:
        """The response's one final write; returns once it (and every event before it) is committed."""
        waiter = asyncio.get_running_loop().create_future()
        self._batch.finals.append(record)
        self._batch.waiters.append(waiter)
        self._wake.set()
        self._urgent.set()
        await waiter

    def _take(self, everything: bool) -> _Batch:
        """What to commit now: everything, or (a final row that cannot wait) the finals, with their
        own responses' events and chunks, and whatever else must not wait; other events stay."""
        batch, self._batch = self._batch, _Batch()
        self._wake.clear()
        self._urgent.clear()
        self._everything = False
        if everything:
            return batch
        ending = {record.id for record in batch.finals} | set(batch.dropped)
        for name in ("events", "chunks"):
            rows: list[tuple] = getattr(batch, name)
            setattr(batch, name, [row for row in rows if row[0] in ending])
            getattr(self._batch, name).extend(row for row in rows if row[0] not in ending)
        if self._batch:
            self._wake.set()
        return batch

    async def _run(self) -> None:
        last = 0.0  # when everything was last committed
        while True:
            await self._wake.wait()
            delay = last + self.interval - time.monotonic()
            if (
                delay > 0 and not self._urgent.is_set()
            ):  # events only: let more gather, up to interval after the last full commit
                try:
                    await asyncio.wait_for(self._urgent.wait(), delay)
                except TimeoutError:
                    pass
            everything = self._everything or time.monotonic() >= last + self.interval
            batch = self._take(everything)
            if not batch:
                continue
            if everything:
                last = time.monotonic()
            try:
                await self._commit(batch)
            except Exception as exc:  # a failed commit must not kill the writer: say so, fail the waiters, go on
                log.error(
                    "state store: a write of %d rows failed: %s",
                    len(batch.events) + len(batch.finals) + len(batch.starts),
                    exc,
                )
                for waiter in batch.waiters:
                    if not waiter.done():
                        waiter.set_exception(exc)

    async def _commit(self, batch: _Batch) -> None:
        began = time.perf_counter()
        async with self.db.transaction() as tx:
            if batch.starts:
                await tx.executemany(INSERT + " ON CONFLICT (id) DO NOTHING", batch.starts)
            if batch.events:
                rows = [(rid, first, last, b"\n".join(datas)) for rid, first, last, datas in _grouped(batch.events)]
                await tx.executemany(
                    "INSERT INTO response_events (response_id, seq, last_seq, data) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    rows,
                )
            if batch.chunks:
                rows = [(rid, first, _list_encoder.encode(datas)) for rid, first, _, datas in _grouped(batch.chunks)]
                await tx.executemany(
                    "INSERT INTO response_chunks (response_id, seq, data) VALUES (?, ?, ?) ON CONFLICT DO NOTHING", rows
                )
            now = time.time()
            for record in batch.finals:
                await tx.execute(UPSERT, *record.row(now))
                await tx.execute("DELETE FROM response_chunks WHERE response_id = ?", record.id)
            for response_id in batch.dropped:
                for table in ("response_events", "response_chunks"):
                    await tx.execute(f"DELETE FROM {table} WHERE response_id = ?", response_id)
                await tx.execute(
                    "DELETE FROM responses WHERE id = ? AND status NOT IN ('completed', 'incomplete', 'failed', 'cancelled')",
                    response_id,
                )
        self.commits += 1
        self.rows += len(batch.starts) + len(batch.events) + len(batch.chunks) + len(batch.finals)
        self.busy_s += time.perf_counter() - began
        for waiter in batch.waiters:
            if not waiter.done():
                waiter.set_result(None)
