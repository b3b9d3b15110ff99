"""Files (OpenAI's ``/v1/files``): a batch's input, and the output and error files it makes.

The bytes live in the database beside the batch rows, not in a folder beside the SQLite file: every
gateway of a fleet on PostgreSQL reads the same files without a shared filesystem, and a batch's
output file is written in the same transaction that marks the batch completed, so no reader ever
sees one without the other. A file is at most ``--max-file-size`` (OpenAI's own limit is 200 MB;
a 50,000-line batch of chat requests is a few MB).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from gateway.state.db import Database, Session

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


class Files:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, owner: str, purpose: str, filename: str, content: bytes, tx: Session | None = None) -> dict:
        file_id, created = new_id("file-"), int(time.time())
        await (tx or self.db).execute(
            "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, content) VALUES (?, ?, ?, ?, ?, ?, ?)",
            file_id,
            owner,
            purpose,
            filename,
            len(content),
            created,
            content,
        )
        return file_object((file_id, purpose, filename, len(content), created))

    async def get(self, file_id: str, owner: str) -> dict | None:
        row = await self.db.fetchone(f"SELECT {_COLUMNS} FROM files WHERE id = ? AND owner = ?", file_id, owner)
        return None if row is None else file_object(row)

    async def content(self, file_id: str, owner: str) -> bytes | None:
        row = await self.db.fetchone("SELECT content FROM files WHERE id = ? AND owner = ?", file_id, owner)
        return None if row is None else bytes(row[0])

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
        return bool(await self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", file_id, owner))
