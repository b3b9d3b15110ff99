"""The Conversations API's storage: a conversation (its metadata) and its items in order, scoped to
the key that created it like responses. A response created with ``conversation`` reads the items as
its history and adds its own input and output items when it ends."""

from __future__ import annotations

import time
import uuid

import msgspec

from gateway.state.db import Database

MAX_ITEMS_AT_ONCE = 20  # items one create or add may bring, as OpenAI's


class Conversations:
    def __init__(self, db: Database) -> None:
        self.db = db

    @staticmethod
    def body(conversation_id: str, created_at: int, metadata: bytes) -> dict:
        return {
            "id": conversation_id,
            "object": "conversation",
            "created_at": created_at,
            "metadata": msgspec.json.decode(metadata),
        }

    async def create(self, owner: str, metadata: dict, items: list[dict]) -> dict:
        conversation_id = f"conv_{uuid.uuid4().hex}"
        created_at = int(time.time())
        encoded = msgspec.json.encode(metadata)
        async with self.db.transaction() as tx:
            await tx.execute(
                "INSERT INTO conversations (id, owner, created_at, metadata, bytes) VALUES (?, ?, ?, ?, ?)",
                conversation_id,
                owner,
                created_at,
                encoded,
                len(encoded),
            )
        if items:
            await self.add(conversation_id, owner, items)
        return self.body(conversation_id, created_at, encoded)

    async def get(self, conversation_id: str, owner: str) -> dict | None:
        row = await self.db.fetchone(
            "SELECT id, created_at, metadata FROM conversations WHERE id = ? AND owner = ?", conversation_id, owner
        )
        return None if row is None else self.body(row[0], row[1], bytes(row[2]))

    async def update(self, conversation_id: str, owner: str, metadata: dict) -> dict | None:
        count = await self.db.execute(
            "UPDATE conversations SET metadata = ? WHERE id = ? AND owner = ?",
            msgspec.json.encode(metadata),
            conversation_id,
            owner,
        )
        return await self.get(conversation_id, owner) if count else None

    async def delete(self, conversation_id: str, owner: str) -> bool:
        async with self.db.transaction() as tx:
            found = await tx.execute("DELETE FROM conversations WHERE id = ? AND owner = ?", conversation_id, owner)
            if found:
                await tx.execute("DELETE FROM conversation_items WHERE conversation_id = ?", conversation_id)
        return bool(found)

    async def add(self, conversation_id: str, owner: str, items: list[dict]) -> list[dict] | None:
        """Append items (each given an id if it has none); None when the conversation is not the owner's."""
        async with self.db.transaction() as tx:
            if (
                await tx.fetchone("SELECT 1 FROM conversations WHERE id = ? AND owner = ?", conversation_id, owner)
                is None
            ):
                return None
            row = await tx.fetchone(
                "SELECT COALESCE(MAX(position), -1) FROM conversation_items WHERE conversation_id = ?", conversation_id
            )
            start = int(row[0]) + 1 if row else 0
            rows = [(conversation_id, start + i, item["id"], msgspec.json.encode(item)) for i, item in enumerate(items)]
            await tx.executemany(
                "INSERT INTO conversation_items (conversation_id, position, id, data) VALUES (?, ?, ?, ?)", rows
            )
            size = sum(len(r[3]) for r in rows)
            await tx.execute("UPDATE conversations SET bytes = bytes + ? WHERE id = ?", size, conversation_id)
        return items

    async def items(self, conversation_id: str, owner: str) -> list[dict] | None:
        if await self.get(conversation_id, owner) is None:
            return None
        rows = await self.db.fetch(
            "SELECT data FROM conversation_items WHERE conversation_id = ? ORDER BY position", conversation_id
        )
        return [msgspec.json.decode(row[0]) for row in rows]

    async def item(self, conversation_id: str, owner: str, item_id: str) -> dict | None:
        if await self.get(conversation_id, owner) is None:
            return None
        row = await self.db.fetchone(
            "SELECT data FROM conversation_items WHERE conversation_id = ? AND id = ?", conversation_id, item_id
        )
        return None if row is None else msgspec.json.decode(row[0])

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        if await self.get(conversation_id, owner) is None:
            return False
        return bool(
            await self.db.execute(
                "DELETE FROM conversation_items WHERE conversation_id = ? AND id = ?", conversation_id, item_id
            )
        )

    async def purge(self, cutoff: int) -> int:
        ids = [row[0] for row in await self.db.fetch("SELECT id FROM conversations WHERE created_at < ?", cutoff)]
        if ids:
            async with self.db.transaction() as tx:
                await tx.executemany("DELETE FROM conversations WHERE id = ?", [(i,) for i in ids])
                await tx.executemany("DELETE FROM conversation_items WHERE conversation_id = ?", [(i,) for i in ids])
        return len(ids)
