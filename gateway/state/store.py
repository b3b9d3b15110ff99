"""The state store: responses on SQLite or PostgreSQL, shared by every gateway that names the same
``--state-url``, each scoped to the key that created it.

Reads and deletes go straight to the database; writes go through ``Writer`` (group commits, never
on the token path). A continuation's history is the chain of ``previous_id``: each row keeps only
its own turn's messages, so a long conversation costs its length once, not once per turn.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import msgspec

from gateway.state.conversations import Conversations
from gateway.state.db import Database, connect
from gateway.state.migrations import migrate
from gateway.state.records import READ_COLUMNS, TERMINAL, StoredResponse, stored
from gateway.state.writer import Writer

log = logging.getLogger(__name__)

MAX_CHAIN = 10_000
_FINISHED = (
    "(" + ", ".join(f"'{status}'" for status in TERMINAL) + ")"
)  # turns a continuation's history walks back at most


@dataclass(slots=True)
class Limits:
    """``--state-max-age`` / ``--state-max-bytes`` / ``--state-max-response-bytes`` / ``--state-max-key-bytes``,
    and ``--state-log-interval`` (how long a stream's events gather before they are written)."""

    max_age_s: float = 30 * 86400.0
    max_bytes: int = 8 * 2**30
    max_response_bytes: int = 2**20
    max_key_bytes: int = 256 * 2**20
    log_interval_s: float = 0.5


class StateStore:
    def __init__(self, db: Database, limits: Limits) -> None:
        self.db = db
        self.limits = limits
        self.writer = Writer(db, limits.log_interval_s)
        self.conversations = Conversations(db)
        self.gateway_id = uuid.uuid4().hex  # this process, in the lease table

    @classmethod
    async def open(cls, url: str, limits: Limits) -> StateStore:
        db = await connect(url)
        applied = await migrate(db)
        if applied:
            log.info("state store %s: applied schema migrations %s", db.dialect, applied)
        store = cls(db, limits)
        store.writer.start()
        return store

    async def close(self) -> None:
        await self.writer.stop()
        await self.db.execute("DELETE FROM gateways WHERE id = ?", self.gateway_id)
        await self.db.close()

    # ---- reads -----------------------------------------------------------------------------------

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        """The response if ``owner`` stored it (anyone else's is as good as absent: a 404)."""
        row = await self.db.fetchone(
            f"SELECT {READ_COLUMNS} FROM responses WHERE id = ? AND owner = ?", response_id, owner
        )
        return None if row is None else stored(row)

    async def history(self, response_id: str, owner: str) -> list[dict]:
        """The chat messages of the chain that ends at ``response_id``, oldest first (instructions
        are not carried). A turn deleted or purged on the way ends the walk there."""
        rows = await self.db.fetch(
            "WITH RECURSIVE chain (id, previous_id, messages, depth) AS ("
            " SELECT id, previous_id, messages, 0 FROM responses WHERE id = ? AND owner = ?"
            " UNION ALL SELECT r.id, r.previous_id, r.messages, c.depth + 1 FROM responses r JOIN chain c ON r.id = c.previous_id"
            " WHERE r.owner = ? AND c.depth < ?)"
            " SELECT messages FROM chain ORDER BY depth DESC",
            response_id,
            owner,
            owner,
            MAX_CHAIN,
        )
        messages: list[dict] = []
        for (blob,) in rows:
            messages += msgspec.json.decode(blob)
        return messages

    async def input_items(self, response_id: str, owner: str) -> list[dict] | None:
        row = await self.db.fetchone("SELECT input_items FROM responses WHERE id = ? AND owner = ?", response_id, owner)
        return None if row is None else msgspec.json.decode(row[0])

    async def events_after(self, response_id: str, seq: int) -> list[tuple[int, bytes]]:
        """The logged events numbered above ``seq``, in order: (number, the event's JSON)."""
        rows = await self.db.fetch(
            "SELECT seq, data FROM response_events WHERE response_id = ? AND last_seq > ? ORDER BY seq",
            response_id,
            seq,
        )
        events = []
        for first, data in rows:
            events += [(first + i, line) for i, line in enumerate(bytes(data).split(b"\n")) if first + i > seq]
        return events

    async def chunks(self, response_id: str) -> list[bytes]:
        """The logged worker outputs (each msgpack), in order."""
        rows = await self.db.fetch("SELECT data FROM response_chunks WHERE response_id = ? ORDER BY seq", response_id)
        return [chunk for row in rows for chunk in msgspec.msgpack.decode(bytes(row[0]), type=list[bytes])]

    # ---- deletes ---------------------------------------------------------------------------------

    async def delete(self, response_id: str, owner: str) -> bool:
        """Delete really deletes: the row, its input items, its event log."""
        async with self.db.transaction() as tx:
            found = await tx.execute("DELETE FROM responses WHERE id = ? AND owner = ?", response_id, owner)
            if found:
                await tx.execute("DELETE FROM response_events WHERE response_id = ?", response_id)
                await tx.execute("DELETE FROM response_chunks WHERE response_id = ?", response_id)
        return bool(found)

    async def delete_ids(self, ids: list[str]) -> None:
        async with self.db.transaction() as tx:
            for table, column in (
                ("responses", "id"),
                ("response_events", "response_id"),
                ("response_chunks", "response_id"),
            ):
                await tx.executemany(f"DELETE FROM {table} WHERE {column} = ?", [(i,) for i in ids])

    # ---- bounds ----------------------------------------------------------------------------------

    async def owner_bytes(self, owner: str) -> int:
        row = await self.db.fetchone("SELECT COALESCE(SUM(bytes), 0) FROM responses WHERE owner = ?", owner)
        return int(row[0]) if row else 0

    async def fit_owner(self, owner: str, keep: str) -> int:
        """Drop ``owner``'s oldest finished responses until it is within ``--state-max-key-bytes``
        (never ``keep``, the one just written): one client cannot push out another's. How many went."""
        excess = await self.owner_bytes(owner) - self.limits.max_key_bytes
        return await self._drop_oldest(excess, "owner = ? AND id <> ?", owner, keep) if excess > 0 else 0

    def fit_owner_soon(self, owner: str, keep: str) -> None:
        """``fit_owner`` after the response went out (a failure is logged: the next write tries again)."""

        async def fit() -> None:
            try:
                await self.fit_owner(owner, keep)
            except Exception as exc:
                log.warning("state store: could not fit a key within --state-max-key-bytes: %s", exc)

        asyncio.get_running_loop().create_task(fit())

    async def purge(self, now: float | None = None) -> dict[str, int]:
        """The background purge: expired responses (``--state-max-age``), then the oldest until the
        whole store is within ``--state-max-bytes``; runs whose gateway died and that nobody took
        over within the retention of a request are marked failed."""
        now = time.time() if now is None else now
        cutoff = int(now - self.limits.max_age_s)
        expired = [row[0] for row in await self.db.fetch("SELECT id FROM responses WHERE created_at < ?", cutoff)]
        if expired:
            await self.delete_ids(expired)
        await self.conversations.purge(cutoff)
        row = await self.db.fetchone("SELECT COALESCE(SUM(bytes), 0) FROM responses")
        excess = int(row[0]) - self.limits.max_bytes if row else 0
        evicted = await self._drop_oldest(excess, "1 = 1") if excess > 0 else 0
        return {"expired": len(expired), "evicted": evicted}

    async def _drop_oldest(self, excess: int, where: str, *args: object) -> int:
        rows = await self.db.fetch(
            f"SELECT id, bytes FROM responses WHERE {where} AND status IN {_FINISHED} ORDER BY created_at, id LIMIT 1000",
            *args,
        )
        ids = []
        for response_id, size in rows:
            if excess <= 0:
                break
            ids.append(response_id)
            excess -= int(size)
        if ids:
            await self.delete_ids(ids)
        return len(ids)

    async def total_bytes(self) -> int:
        row = await self.db.fetchone("SELECT COALESCE(SUM(bytes), 0) FROM responses")
        return int(row[0]) if row else 0
