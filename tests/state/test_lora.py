"""The fleet's record of runtime LoRA adapters (migration 5), on a SQLite file and a real
PostgreSQL server: what one gateway records, another reads; an unload stays as a None."""

from __future__ import annotations

import asyncio

from gateway.state.adapters import LoraTable
from gateway.state.db import connect
from gateway.state.migrations import migrate


def test_loads_and_unloads_recorded_by_one_gateway_are_read_by_another(url):
    async def main() -> None:
        one, other = await connect(url), await connect(url)
        await migrate(one)
        writer, reader = LoraTable(one), LoraTable(other)
        await writer.record("m", "a", "/a")
        await writer.record("m", "b", "/b")
        await writer.record("n", "a", "/n-a")
        await writer.record("m", "b", None)
        await writer.record("m", "a", "/a2")
        assert await reader.wanted() == {"m": {"a": "/a2", "b": None}, "n": {"a": "/n-a"}}
        await writer.forget("n", "a")
        assert await reader.wanted() == {"m": {"a": "/a2", "b": None}}
        await one.close()
        await other.close()

    asyncio.run(main())
