"""The LoRA adapters loaded and unloaded at runtime, per model: the fleet's one record of them, so
that every gateway hands a joining worker the same set (gateway/fleet/lora.py ``LoraSync``) and learns
of a load made through another gateway at its next heartbeat.

A row per adapter name a runtime command touched: its folder, or NULL once unloaded. An unloaded
row stays, so a worker that comes back with the adapter (it was away at the unload, or its
``--lora`` names it) is told to drop it; a new load of the name replaces the row.
"""

from __future__ import annotations

import time

from gateway.state.db import Database

Wanted = dict[str, dict[str, str | None]]  # model -> adapter name -> its folder (None: unloaded)

_UPSERT = (
    "INSERT INTO lora_adapters (model, name, path, updated_at) VALUES (?, ?, ?, ?)"
    " ON CONFLICT (model, name) DO UPDATE SET path = excluded.path, updated_at = excluded.updated_at"
)


class LoraTable:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def record(self, model: str, name: str, path: str | None) -> None:
        """The adapter's folder, or None once unloaded."""
        await self.db.execute(_UPSERT, model, name, path, time.time())

    async def forget(self, model: str, name: str) -> None:
        """No record of the adapter (a load that failed, where there was none before)."""
        await self.db.execute("DELETE FROM lora_adapters WHERE model = ? AND name = ?", model, name)

    async def wanted(self) -> Wanted:
        """Every model's runtime adapters, unloaded ones included (as None)."""
        found: Wanted = {}
        for model, name, path in await self.db.fetch("SELECT model, name, path FROM lora_adapters"):
            found.setdefault(model, {})[name] = path
        return found
