"""Managed keys and their shared counts, on a SQLite file and a real PostgreSQL server: the secret
is never stored, revocation and updates, and per-minute windows and in-flight counts that two
gateways (two connections, two ``Windows``) share exactly."""

from __future__ import annotations

import asyncio
import time

from gateway.state.db import connect
from gateway.state.keys import KeyCache, KeyStore, digest
from gateway.state.leases import Leases
from gateway.state.migrations import migrate
from gateway.state.usage import UsageMeter
from gateway.state.windows import Windows


async def opened(url: str):
    db = await connect(url)
    await migrate(db)
    return db


def test_keys_are_stored_hashed_listed_updated_and_revoked(url):
    async def main() -> None:
        db = await opened(url)
        keys = KeyStore(db)
        made = await keys.create("team-a", rpm=5, models=["m1"], default_priority=3)
        assert made.secret.startswith("lp-") and len(made.secret) > 40 and made.hash == digest(made.secret)
        rows = await db.fetch("SELECT * FROM api_keys")
        assert made.secret not in repr(rows) and made.hash in repr(rows), "only the digest is stored"
        assert "secret" not in (await keys.get(made.id)).view() and "hash" not in made.view()
        cache = KeyCache(keys, ttl_s=60)
        found = await cache.lookup(made.secret)
        assert (found.id, found.rpm, found.models, found.default_priority) == (made.id, 5, ["m1"], 3)
        assert await cache.lookup(made.secret[:-1] + "x") is None and await cache.lookup("sk-other") is None
        changed = await keys.update(made.id, rpm=None, tpm=100, models=None, name="team-b")
        assert (changed.name, changed.rpm, changed.tpm, changed.models) == ("team-b", None, 100, None)
        await keys.revoke(made.id)
        assert (await cache.lookup(made.secret)).id == made.id, "another gateway's revocation shows after the ttl"
        cache.forget(found)
        assert await cache.lookup(made.secret) is None
        assert [k.view()["status"] for k in await keys.list()] == ["revoked"]
        await db.close()

    asyncio.run(main())


def test_two_gateways_share_the_minute_window_exactly(url):
    """Twelve requests at once through two gateways' own connections against rpm 5: five admitted,
    whichever gateway took them; tokens count toward tpm, output tokens at the heartbeat."""

    async def main() -> None:
        dbs = [await opened(url), await connect(url)]
        windows = [Windows(db, f"g{i}", lease_s=10, ttl_s=1) for i, db in enumerate(dbs)]
        key = await KeyStore(dbs[0]).create("a", rpm=5)
        results = await asyncio.gather(*(windows[i % 2].take(key.id, 10, 5, None) for i in range(12)))
        admitted = [w for w in results if w.admitted]
        assert len(admitted) == 5 and sorted(w.requests for w in admitted) == [1, 2, 3, 4, 5]
        assert all(w.requests == 5 for w in results if not w.admitted)
        assert 0 < admitted[0].reset_at - time.time() <= 60
        tokens = await KeyStore(dbs[0]).create("b", tpm=25)
        assert (await windows[0].take(tokens.id, 20, None, 25)).admitted
        windows[1].add_output(tokens.id, 10)
        await windows[1].sync({})
        refused = await windows[0].take(tokens.id, 1, None, 25)
        assert not refused.admitted and refused.tokens == 30
        for db in dbs:
            await db.close()

    asyncio.run(main())


def test_in_flight_counts_and_monthly_spend_are_seen_by_the_other_gateway(url):
    async def main() -> None:
        dbs = [await opened(url), await connect(url)]
        for i, db in enumerate(dbs):
            await Leases(db, f"g{i}", 10).renew()
        windows = [Windows(db, f"g{i}", lease_s=10, ttl_s=0) for i, db in enumerate(dbs)]
        await windows[0].sync({"key_a": 3, "key_b": 0})
        await windows[1].sync({"key_a": 1})
        assert windows[1].elsewhere == {"key_a": 3} and windows[0].elsewhere == {}
        await windows[0].sync({"key_a": 3})
        assert windows[0].elsewhere == {"key_a": 1}
        await dbs[0].execute("UPDATE gateways SET seen_at = ? WHERE id = 'g0'", time.time() - 60)
        await windows[1].sync({})
        assert windows[1].elsewhere == {}, "a dead gateway's counts hold nothing"
        meter = UsageMeter()
        meter.record("owner-a", "m", prompt=100, cached=0, output=20)
        assert meter.pending_tokens("owner-a") == 120
        await meter.flush(dbs[0])
        assert await windows[1].spent("owner-a", unflushed=5) == 125
        assert (await meter.month_totals(dbs[1]))["owner-a"]["output_tokens"] == 20
        for db in dbs:
            await db.close()

    asyncio.run(main())
