"""The state store against both of its databases: a SQLite file and a real PostgreSQL server.

Scoping, continuation chains, input items, DELETE, budgets and the purge, migrations (also two at
once), the writer's group commits, leases and takeover claims, usage."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from gateway.state.db import connect
from gateway.state.leases import Leases
from gateway.state.migrations import MIGRATIONS, SchemaTooNew, migrate
from gateway.state.records import ResponseRecord, owner_of
from gateway.state.store import Limits, StateStore
from gateway.state.usage import UsageMeter, day_of


def run(coro):
    return asyncio.run(coro)


def record(
    response_id: str,
    owner: str,
    previous: str | None = None,
    text: str = "hi",
    created: int | None = None,
    pad: int = 0,
) -> ResponseRecord:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": f"re: {text}"}]
    return ResponseRecord(
        id=response_id,
        owner=owner,
        created_at=int(time.time()) if created is None else created,
        model="m",
        status="completed",
        body=msgspec.json.encode({"id": response_id, "pad": "x" * pad}),
        input_items=msgspec.json.encode(
            [{"id": f"msg_{response_id}", "type": "message", "role": "user", "content": text}]
        ),
        messages=msgspec.json.encode(messages),
        previous_id=previous,
        input_tokens=10,
        output_tokens=3,
    )


async def opened(url: str, **limits) -> StateStore:
    return await StateStore.open(url, Limits(**limits))


def test_responses_are_scoped_chained_listed_and_really_deleted(url):
    async def main() -> None:
        store = await opened(url)
        k1, k2 = owner_of("k1"), owner_of("k2")
        await store.writer.final(record("r1", k1, text="My name is Ada."))
        await store.writer.final(record("r2", k1, previous="r1", text="What is my name?"))
        assert (await store.get("r1", k1)).status == "completed"
        assert await store.get("r1", k2) is None, "another key's response is absent to it"
        assert await store.history("r2", k2) == []
        history = await store.history("r2", k1)
        assert [m["content"] for m in history] == [
            "My name is Ada.",
            "re: My name is Ada.",
            "What is my name?",
            "re: What is my name?",
        ]
        assert (await store.input_items("r2", k1))[0]["id"] == "msg_r2" and await store.input_items("r2", k2) is None
        assert not await store.delete("r1", k2) and await store.get("r1", k1) is not None
        assert await store.delete("r1", k1)
        count = await store.db.fetchone("SELECT COUNT(*) FROM responses WHERE id = 'r1'")
        assert count[0] == 0 and [m["content"] for m in await store.history("r2", k1)] == [
            "What is my name?",
            "re: What is my name?",
        ]
        await store.close()

    run(main())


def test_a_restart_keeps_everything_and_migrations_run_once(url):
    async def main() -> None:
        store = await opened(url)
        await store.writer.final(record("kept", owner_of("k")))
        await store.close()
        again = await opened(url)
        assert (await again.get("kept", owner_of("k"))).body == msgspec.json.encode({"id": "kept", "pad": ""})
        assert await migrate(again.db) == [], "nothing left to apply"
        versions = [row[0] for row in await again.db.fetch("SELECT version FROM schema_migrations ORDER BY version")]
        assert versions == [v for v, _, _ in MIGRATIONS]
        await again.db.execute("INSERT INTO schema_migrations (version, applied_at) VALUES (999, 0)")
        with pytest.raises(SchemaTooNew):
            await migrate(again.db)
        await again.close()

    run(main())


def test_two_gateways_migrating_at_once_apply_each_step_once(postgres):
    url = postgres.database("store_concurrent_migrations")

    async def main() -> None:
        dbs = [await connect(url) for _ in range(4)]
        applied = await asyncio.gather(*(migrate(db) for db in dbs))
        assert sorted(applied, key=len)[-1] == [v for v, _, _ in MIGRATIONS] and sum(len(a) for a in applied) == len(
            MIGRATIONS
        )
        for db in dbs:
            await db.close()

    run(main())


def test_purge_by_age_and_total_bytes_and_the_key_budget(url):
    async def main() -> None:
        store = await opened(url, max_age_s=3600, max_bytes=25_000, max_key_bytes=12_000)
        now = int(time.time())
        a, b = owner_of("a"), owner_of("b")
        await store.writer.final(record("old", a, created=now - 7200))
        await store.writer.final(record("new", a, created=now))
        counts = await store.purge(now)
        assert counts["expired"] == 1 and await store.get("old", a) is None and await store.get("new", a) is not None
        # The key budget: a's oldest go, b's stay.
        await store.writer.final(record("b1", b, created=now - 5, pad=4000))
        for i in range(4):
            await store.writer.final(record(f"a{i}", a, created=now - 4 + i, pad=4000))
            await store.fit_owner(a, f"a{i}")
        assert (
            await store.owner_bytes(a) <= 12_000
            and await store.get("a3", a) is not None
            and await store.get("a0", a) is None
        )
        assert await store.get("b1", b) is not None
        # The total bound: the oldest go first, whoever's they are.
        for i in range(4):
            await store.writer.final(record(f"c{i}", b, created=now + i, pad=4000))
        assert await store.total_bytes() > 25_000
        counts = await store.purge(now)
        assert counts["evicted"] >= 1 and await store.total_bytes() <= 25_000 and await store.get("c3", b) is not None
        await store.close()

    run(main())


def test_the_writer_commits_events_in_groups_and_the_final_row_with_them(url):
    async def main() -> None:
        store = await opened(url)
        owner = owner_of("k")
        start = record("run", owner)
        start.status, start.request, start.gateway = "in_progress", b"{}", store.gateway_id
        store.writer.started(start)
        for seq in range(200):
            store.writer.event("run", seq, b'{"type":"response.output_text.delta"}')
            store.writer.chunk("run", seq, b"\x90")
            if seq % 50 == 0:
                await asyncio.sleep(0)
        commits = store.writer.commits
        await store.writer.final(record("run", owner))
        assert store.writer.commits - commits <= 3, "200 events went in a few transactions, not one each"
        assert [seq for seq, _ in await store.events_after("run", 189)] == list(range(190, 200))
        assert await store.chunks("run") == [], "a finished run's token chunks are gone"
        row = await store.db.fetchone("SELECT status, request, gateway FROM responses WHERE id = 'run'")
        assert tuple(row) == ("completed", None, None)
        await store.close()

    run(main())


def test_a_final_row_commits_its_own_events_and_leaves_the_other_streams_gathering(url):
    """At 64 streams a response ends several times a second: its commit must not write a row for
    every other stream's pending events (the rows, not the tokens, are what the store costs)."""

    async def main() -> None:
        store = await opened(url)
        owner = owner_of("k")
        for name in ("ending", "running"):
            start = record(name, owner)
            start.status, start.request, start.gateway = "in_progress", b"{}", store.gateway_id
            store.writer.started(start)
        await store.writer.sync()
        for seq in range(3):
            for name in ("ending", "running"):
                store.writer.event(name, seq, b'{"type":"response.output_text.delta"}')
                store.writer.chunk(name, seq, b"\x90")
        rows = store.writer.rows
        await store.writer.final(record("ending", owner))
        assert store.writer.rows - rows == 7, "the final row with its 3 events and 3 chunks, not the other stream's 6"
        assert [seq for seq, _ in await store.events_after("ending", -1)] == [0, 1, 2]
        deadline = asyncio.get_running_loop().time() + 10
        while not await store.events_after("running", -1):  # the other stream's, within the interval
            assert asyncio.get_running_loop().time() < deadline, "the running stream's events were never written"
            await asyncio.sleep(0.05)
        assert [seq for seq, _ in await store.events_after("running", -1)] == [0, 1, 2]
        assert len(await store.chunks("running")) == 3
        await store.close()

    run(main())


def test_a_dead_gateways_run_is_claimed_by_one_gateway(url):
    async def main() -> None:
        stores = [await opened(url) for _ in range(3)]
        dead, *alive = stores
        leases = [
            Leases(s.db, s.gateway_id, lease_s=1.5) for s in stores
        ]  # room for a busy machine between renew and check
        for lease in leases:
            await lease.renew()
        start = record("orphan", owner_of("k"))
        start.status, start.background, start.request, start.gateway = "in_progress", True, b"{}", dead.gateway_id
        dead.writer.started(start)
        plain = record("plain", owner_of("k"))
        plain.status, plain.request, plain.gateway = "in_progress", b"{}", dead.gateway_id
        dead.writer.started(plain)
        await dead.writer.final(record("other", owner_of("k")))  # flushes the start row with it
        assert await leases[1].orphans() == []
        deadline = asyncio.get_running_loop().time() + 10
        while await leases[1].alive(dead.gateway_id):  # until the dead one's lease runs out
            assert asyncio.get_running_loop().time() < deadline, "the lease never ran out"
            await asyncio.sleep(0.05)
        await leases[1].renew()
        await leases[2].renew()
        assert not await leases[1].alive(dead.gateway_id) and await leases[1].alive(alive[1].gateway_id)
        assert await leases[1].orphans() == [("orphan", dead.gateway_id)]
        won = await asyncio.gather(
            leases[1].claim("orphan", dead.gateway_id), leases[2].claim("orphan", dead.gateway_id)
        )
        assert sorted(won) == [False, True]
        # A plain stream nobody resumed is not taken over: it is dropped, once old enough.
        assert await leases[1].abandoned(3600) == [] and await leases[1].abandoned(0) == ["plain"]
        for store in stores:
            await store.close()

    run(main())


def test_usage_adds_up_per_key_model_and_day(url):
    async def main() -> None:
        store = await opened(url)
        meter = UsageMeter()
        k1, k2 = owner_of("k1"), owner_of("k2")
        meter.record(k1, "m", 100, 40, 10)
        meter.record(k1, "m", 50, 0, 5)
        await meter.flush(store.db)
        meter.record(k1, "m", 10, 10, 1)
        meter.record(k2, "other", 7, 0, 2)
        rows = await meter.report(store.db, day_of(time.time() - 86400), day_of(time.time() + 86400))
        by_key = {(r["key"], r["model"]): r for r in rows}
        mine = by_key[(k1[:12], "m")]
        assert (mine["requests"], mine["input_tokens"], mine["cached_tokens"], mine["output_tokens"]) == (
            3,
            160,
            50,
            16,
        )
        assert by_key[(k2[:12], "other")]["output_tokens"] == 2 and len(rows) == 2
        await store.close()

    run(main())


def test_a_gateway_starts_while_another_holds_the_sqlite_file_for_longer_than_sqlites_default_wait(tmp_path):
    """Another gateway migrating a fresh file under load holds its write lock for seconds, before the
    file is in WAL mode; the opener waits it out (SQLite's own default gives up after 5 s)."""
    import sqlite3
    import threading

    path = tmp_path / "state.db"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    holder.execute("CREATE TABLE held (x)")
    release = threading.Timer(6.0, lambda: holder.execute("COMMIT"))
    release.start()

    async def main() -> float:
        began = time.monotonic()
        db = await connect(f"sqlite:///{path}")
        waited = time.monotonic() - began
        assert [row[0] for row in await db.fetch("PRAGMA journal_mode")] == ["wal"]
        await db.close()
        return waited

    try:
        assert run(main()) >= 5.0, "the open did wait for the writer"
    finally:
        release.join()
        holder.close()
