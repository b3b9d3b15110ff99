"""One small async database interface over the two back-ends the state store runs on.

- SQLite (the default, embedded) through aiosqlite: the standard library's sqlite3 on a thread of its
  own, so a query never blocks the event loop. One connection in WAL mode; a lock serializes its
  transactions (SQLite has one writer anyway), and several gateway processes on one host may share
  the file (``busy_timeout`` waits for the other writer).
- PostgreSQL (a fleet) through asyncpg: a binary-protocol driver written for asyncio, with a pool
  and prepared statements cached per connection. Queries are written once with ``?`` placeholders
  and rewritten to ``$n`` for it.

Both hand back rows as tuples (asyncpg's Records index like them) and take ``bytes`` for blobs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

Row = Sequence[Any]
log = logging.getLogger(__name__)


class Session:
    """What a query runs on: the database outside a transaction, or one transaction."""

    async def execute(self, sql: str, *args: Any) -> int:
        """Run a statement; the number of rows it touched."""
        raise NotImplementedError

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        raise NotImplementedError

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        raise NotImplementedError

    async def fetchone(self, sql: str, *args: Any) -> Row | None:
        rows = await self.fetch(sql, *args)
        return rows[0] if rows else None


class Database(Session):
    dialect = ""

    def transaction(self):  # an async context manager of a Session
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


async def _switch_to_wal(connection: Any, attempts: int = 40) -> None:
    """SQLite answers the journal-mode switch with "database is locked" at once, without its busy
    handler, while another process opens the same file (two gateways starting together), so retry."""
    import sqlite3

    for attempt in range(attempts):
        try:
            await connection.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.25)


class SQLiteDatabase(Database):
    dialect = "sqlite"

    def __init__(self, connection: Any) -> None:
        self._db = connection
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, path: str) -> SQLiteDatabase:
        import aiosqlite

        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        # autocommit (transactions are explicit); the busy timeout is set before any other statement
        connection = await aiosqlite.connect(path, isolation_level=None, timeout=10)
        await _switch_to_wal(connection)
        # secure_delete: a deleted response's bytes are overwritten in the file, not left in free pages
        for pragma in ("synchronous=NORMAL", "secure_delete=FAST"):
            await connection.execute(f"PRAGMA {pragma}")
        return cls(connection)

    async def _execute(self, sql: str, args: Sequence[Any]) -> int:
        cursor = await self._db.execute(sql, args)
        count = cursor.rowcount
        await cursor.close()
        return count

    async def _fetch(self, sql: str, args: Sequence[Any]) -> list[Row]:
        async with self._db.execute(sql, args) as cursor:
            return list(await cursor.fetchall())

    async def execute(self, sql: str, *args: Any) -> int:
        async with self._lock:
            return await self._execute(sql, args)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        async with self._lock:
            await self._db.executemany(sql, list(rows))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        async with self._lock:
            return await self._fetch(sql, args)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Session]:
        async with self._lock:
            await self._db.execute("BEGIN IMMEDIATE")  # takes the write lock now: no upgrade deadlock later
            try:
                yield _SQLiteTransaction(self)
            except BaseException:
                await self._db.execute("ROLLBACK")
                raise
            await self._db.execute("COMMIT")

    async def close(self) -> None:
        await self._db.close()


class _SQLiteTransaction(Session):
    def __init__(self, db: SQLiteDatabase) -> None:
        self._db = db

    async def execute(self, sql: str, *args: Any) -> int:
        return await self._db._execute(sql, args)

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self._db._db.executemany(sql, list(rows))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return await self._db._fetch(sql, args)


_PLACEHOLDER = re.compile(r"\?")


def postgres_sql(sql: str) -> str:
    """``?`` placeholders as asyncpg's ``$1, $2, ...`` (the queries here hold no literal '?')."""
    counter = iter(range(1, 10_000))
    return _PLACEHOLDER.sub(lambda _: f"${next(counter)}", sql)


def _count(status: str) -> int:
    """Rows touched, from asyncpg's command tag (``UPDATE 3``, ``INSERT 0 1``)."""
    tail = status.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else 0


class _PostgresSession(Session):
    def __init__(self, target: Any) -> None:
        self._target = target  # a pool or a connection: both run queries
        self._sql: dict[str, str] = {}

    def _convert(self, sql: str) -> str:
        converted = self._sql.get(sql)
        if converted is None:
            converted = self._sql[sql] = postgres_sql(sql)
        return converted

    async def execute(self, sql: str, *args: Any) -> int:
        return _count(await self._target.execute(self._convert(sql), *args))

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        await self._target.executemany(self._convert(sql), list(rows))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return list(await self._target.fetch(self._convert(sql), *args))


class PostgresDatabase(_PostgresSession, Database):
    dialect = "postgresql"

    @classmethod
    async def open(cls, url: str, pool_size: int = 8, wait_s: float = 60.0) -> PostgresDatabase:
        """Connect, waiting up to ``wait_s`` for a server that is still starting (a fleet's gateways
        and its database start together)."""
        import asyncpg

        deadline = time.monotonic() + wait_s
        while True:
            try:
                return cls(await asyncpg.create_pool(url, min_size=1, max_size=pool_size, command_timeout=30))
            except (OSError, asyncpg.CannotConnectNowError) as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("state store: PostgreSQL not reachable yet (%s); trying again", exc)
                await asyncio.sleep(1.0)

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[Session]:
        async with self._target.acquire() as connection, connection.transaction():
            session = _PostgresSession(connection)
            session._sql = self._sql
            yield session

    async def close(self) -> None:
        await self._target.close()


def sqlite_path(url: str) -> str:
    """``sqlite:///relative.db``, ``sqlite:////abs/path.db`` (SQLAlchemy's spelling), or ``sqlite:///:memory:``."""
    path = url.split("://", 1)[1]
    path = path[1:] if path.startswith("/") else path
    return os.path.expanduser(path)


async def connect(url: str) -> Database:
    """Open the database ``--state-url`` names."""
    scheme = urlsplit(url).scheme.split("+")[0]
    if scheme == "sqlite":
        return await SQLiteDatabase.open(sqlite_path(url))
    if scheme in ("postgresql", "postgres"):
        return await PostgresDatabase.open(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    raise ValueError(f"--state-url must start with sqlite:/// or postgresql://; got {url!r}")
