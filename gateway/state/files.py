"""Files (OpenAI's ``/v1/files``): a batch's input, and the output and error files it makes.

A file's row (owner, name, size) is in the database beside the batch rows. Its bytes are in the
row too by default: every gateway of a fleet on PostgreSQL reads the same files without a shared
filesystem or a bucket, and a batch's output file is written in the same transaction that marks
the batch completed, so no reader ever sees one without the other. ``--files-url`` moves the bytes
to a directory or an S3-compatible bucket (gateway/state/file_store.py); they are written before
the row commits and removed if it does not. A row whose ``content`` is shorter than its size has
its bytes there, so files stored before the flag was set stay readable after it. A file is at most
``--max-file-size`` (OpenAI's own limit is 200 MB; a 50,000-line batch of chat requests is a few MB).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from gateway.state.db import Database, Session
from gateway.state.file_store import ContentUnavailable, FileStore

PURPOSES = ("batch", "batch_output", "user_data")
_COLUMNS = "id, purpose, filename, bytes, created_at"


def new_id(prefix: str) -> str:
    """Ids that sort by creation (nanoseconds in hex, then randomness): lists page by id alone."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(6)}"


def file_object(row: Any) -> dict:
    return {
        "id": row[0],
        "object": "file",
        "purpose": row[1],
        "filename": row[2],
        "bytes": int(row[3]),
        "created_at": int(row[4]),
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


@dataclass(slots=True)
class Staged:
    """A new file's id and bytes, already in the file store (if any), its row not yet written."""

    id: str
    content: bytes


class Files:
    def __init__(self, db: Database, store: FileStore | None = None) -> None:
        """``store`` None: the bytes go in the rows."""
        self.db = db
        self.store = store

    async def create(self, owner: str, purpose: str, filename: str, content: bytes) -> dict:
        staged = await self.stage(content)
        try:
            return await self.insert(staged, owner, purpose, filename, self.db)
        except BaseException:
            await self.discard(staged)
            raise

    async def stage(self, content: bytes) -> Staged:
        """A new file's bytes, put in the file store before its row exists."""
        staged = Staged(new_id("file-"), content)
        if self.store is not None:
            await self.store.put(staged.id, content)
        return staged

    async def insert(self, staged: Staged, owner: str, purpose: str, filename: str, tx: Session) -> dict:
        """The row of a staged file, in ``tx``: the file exists once it commits."""
        created = int(time.time())
        await tx.execute(
            "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
            staged.id,
            owner,
            purpose,
            filename,
            len(staged.content),
            created,
            staged.content if self.store is None else b"",
        )
        return file_object((staged.id, purpose, filename, len(staged.content), created))

    async def discard(self, staged: Staged) -> None:
        """The bytes of a staged file whose row did not commit."""
        if self.store is not None:
            await self.store.delete(staged.id)

    async def get(self, file_id: str, owner: str) -> dict | None:
        row = await self.db.fetchone(f"SELECT {_COLUMNS} FROM files WHERE id = ? AND owner = ?", file_id, owner)
        return None if row is None else file_object(row)

    async def content(self, file_id: str, owner: str) -> bytes | None:
        """None: no such file of ``owner``'s. ContentUnavailable: the row is here, its bytes are not."""
        row = await self.db.fetchone("SELECT bytes, content FROM files WHERE id = ? AND owner = ?", file_id, owner)
        if row is None:
            return None
        inline = bytes(row[1])
        if len(inline) == int(row[0]):
            return inline
        if self.store is None:
            raise ContentUnavailable(
                f"the bytes of file {file_id} are in a file store (--files-url) this gateway is not configured with"
            )
        found = await self.store.get(file_id)
        if found is None:
            raise ContentUnavailable(f"the bytes of file {file_id} are missing from {self.store.where}")
        return found

    async def list(
        self, owner: str, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> tuple[list[dict], bool]:
        """A page of ``owner``'s files by creation, and whether more follow."""
        sql, args = f"SELECT {_COLUMNS} FROM files WHERE owner = ?", [owner]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        if after is not None:
            sql, args = sql + (" AND id > ?" if ascending else " AND id < ?"), [*args, after]
        rows = await self.db.fetch(sql + f" ORDER BY id {'ASC' if ascending else 'DESC'} LIMIT ?", *args, limit + 1)
        return [file_object(row) for row in rows[:limit]], len(rows) > limit

    async def delete(self, file_id: str, owner: str) -> bool:
        """The row first, then the bytes: a listed file always has its bytes."""
        if not await self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", file_id, owner):
            return False
        if self.store is not None:
            await self.store.delete(file_id)
        return True
