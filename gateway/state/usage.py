"""Usage you can bill: tokens per key, per model, per day, for every generation of every dialect.

Each finished generation adds to counters in memory (and to Prometheus counters whose ``key`` label
is the key's hash, never the key); the heartbeat adds them to the ``usage`` table in one upsert per
(day, key, model), so the database sees a handful of rows a second however many requests finish.
``GET /v1/usage`` (the admin key only) reads the table.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from gateway.state.db import Database
from gateway.state.records import key_label

FIELDS = ("requests", "input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")
_UPSERT = (
    f"INSERT INTO usage (day, owner, model, {', '.join(FIELDS)}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
    " ON CONFLICT (day, owner, model) DO UPDATE SET " + ", ".join(f"{f} = usage.{f} + excluded.{f}" for f in FIELDS)
)


def day_of(at: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(at))


def month_start(at: float) -> str:
    """The first day of ``at``'s month (UTC), as the usage table spells days."""
    return time.strftime("%Y-%m-01", time.gmtime(at))


class UsageMeter:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._pending: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0] * len(FIELDS))
        self.on_output: Callable[[str, int], None] | None = None  # (owner, output tokens): gateway.policy.quotas
        self.requests = Counter(
            "llmpool_key_requests",
            "Finished generations by API key (hashed) and model",
            ["key", "model"],
            registry=registry,
        )
        self.tokens = Counter(
            "llmpool_key_tokens",
            "Tokens by API key (hashed), model and kind (input, cached, output, reasoning)",
            ["key", "model", "kind"],
            registry=registry,
        )

    def record(
        self, owner: str, model: str, prompt: int, cached: int, output: int, reasoning: int = 0, requests: int = 1
    ) -> None:
        """One generation's tokens (``prompt`` includes ``cached``); ``requests`` 0 for a further choice of one request."""
        counts = self._pending[(day_of(time.time()), owner, model)]
        for i, value in enumerate((requests, prompt, cached, output, reasoning)):
            counts[i] += value
        if self.on_output is not None:
            self.on_output(owner, output)
        label = key_label(owner)
        if requests:
            self.requests.labels(label, model).inc(requests)
        for kind, value in (("input", prompt), ("cached", cached), ("output", output), ("reasoning", reasoning)):
            if value:
                self.tokens.labels(label, model, kind).inc(value)

    def pending_tokens(self, owner: str) -> int:
        """Input and output tokens of ``owner`` not flushed yet."""
        return sum(c[1] + c[3] for (_, o, _), c in self._pending.items() if o == owner)

    async def flush(self, db: Database) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, defaultdict(lambda: [0] * len(FIELDS))
        await db.executemany(_UPSERT, [(*key, *counts) for key, counts in pending.items()])

    async def month_totals(self, db: Database) -> dict[str, dict[str, int]]:
        """Each owner's counts this calendar month (UTC), every model together."""
        await self.flush(db)
        sums = ", ".join(f"SUM({f})" for f in FIELDS)
        rows = await db.fetch(
            f"SELECT owner, {sums} FROM usage WHERE day >= ? GROUP BY owner", month_start(time.time())
        )
        return {r[0]: {f: int(v) for f, v in zip(FIELDS, r[1:])} for r in rows}

    async def report(
        self, db: Database, start: str, end: str, owner: str | None = None, model: str | None = None
    ) -> list[dict]:
        """Rows of the usage table from day ``start`` to ``end`` (inclusive, YYYY-MM-DD)."""
        await self.flush(db)
        sql = f"SELECT day, owner, model, {', '.join(FIELDS)} FROM usage WHERE day >= ? AND day <= ?"
        args: list[object] = [start, end]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        if model is not None:
            sql, args = sql + " AND model = ?", [*args, model]
        rows = await db.fetch(sql + " ORDER BY day, owner, model", *args)
        return [
            {"day": r[0], "key": key_label(r[1]), "model": r[2], **{f: int(v) for f, v in zip(FIELDS, r[3:])}}
            for r in rows
        ]
