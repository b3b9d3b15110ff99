"""What managed keys have used, as every gateway of a fleet sees it: requests and tokens per key per
minute, generations in flight per key, tokens this month.

- **Per-minute windows** (``key_windows``): admitting a request is one conditional upsert that adds
  it to its key's row for the current minute only while the row is under both limits, and returns
  the counts (``RETURNING``). Two gateways admitting at once cannot both take the last request: the
  row's update is atomic on SQLite and PostgreSQL alike. A request adds its prompt tokens then; its
  output tokens are added when it ends, in one statement per key at each heartbeat.
- **In flight** (``key_inflight``): each gateway writes its own count per key at each heartbeat and
  reads the others' (of live gateways only: a dead one's counts no longer hold anything).
- **This month** reads the ``usage`` table (what every gateway flushed) plus this gateway's
  unflushed counts, at most once per key per ``ttl_s``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

from gateway.state.db import Database
from gateway.state.usage import month_start

WINDOW_S = 60
UNLIMITED = 2**62
_TAKE = (
    "INSERT INTO key_windows (key_id, window_start, requests, tokens) VALUES (?, ?, 1, ?)"
    " ON CONFLICT (key_id, window_start) DO UPDATE SET requests = key_windows.requests + 1,"
    " tokens = key_windows.tokens + excluded.tokens"
    " WHERE key_windows.requests < ? AND key_windows.tokens < ? RETURNING requests, tokens"
)
_ADD = (
    "INSERT INTO key_windows (key_id, window_start, requests, tokens) VALUES (?, ?, 0, ?)"
    " ON CONFLICT (key_id, window_start) DO UPDATE SET tokens = key_windows.tokens + excluded.tokens"
)


@dataclass(slots=True)
class Window:
    """A key's counts in the current minute, after this request (or without it, when refused)."""

    admitted: bool
    requests: int
    tokens: int
    reset_at: float  # when the window ends (epoch seconds)


class Windows:
    def __init__(self, db: Database, gateway_id: str, lease_s: float, ttl_s: float) -> None:
        self.db = db
        self.gateway_id = gateway_id
        self.lease_s = lease_s
        self.ttl_s = ttl_s
        self.elsewhere: dict[str, int] = {}  # key id -> generations in flight on other live gateways
        self._output: dict[tuple[str, int], int] = defaultdict(int)  # (key id, window) -> tokens to add
        self._spent: dict[str, tuple[float, int]] = {}  # owner -> (read at, tokens this month)

    async def take(self, key_id: str, tokens: int, rpm: int | None, tpm: int | None) -> Window:
        """Count one request of ``tokens`` prompt tokens in this minute, if the key has room."""
        now = time.time()
        start = int(now // WINDOW_S * WINDOW_S)
        rows = await self.db.fetch(_TAKE, key_id, start, tokens, rpm or UNLIMITED, tpm or UNLIMITED)
        if rows:
            return Window(True, int(rows[0][0]), int(rows[0][1]), start + WINDOW_S)
        row = await self.db.fetchone(
            "SELECT requests, tokens FROM key_windows WHERE key_id = ? AND window_start = ?", key_id, start
        )
        return Window(False, int(row[0]), int(row[1]), start + WINDOW_S)

    def add_output(self, key_id: str, tokens: int) -> None:
        """A finished generation's output tokens, added to its key's current minute at the next flush."""
        if tokens:
            self._output[(key_id, int(time.time() // WINDOW_S * WINDOW_S))] += tokens

    async def spent(self, owner: str, unflushed: int) -> int:
        """Tokens (prompt + output) the key's owner used this month, fleet-wide."""
        now = time.monotonic()
        cached = self._spent.get(owner)
        if cached is None or now - cached[0] > self.ttl_s:
            row = await self.db.fetchone(
                "SELECT COALESCE(SUM(input_tokens + output_tokens), 0) FROM usage WHERE owner = ? AND day >= ?",
                owner,
                month_start(time.time()),
            )
            cached = self._spent[owner] = (now, int(row[0]))
        return cached[1] + unflushed

    async def sync(self, inflight: dict[str, int]) -> None:
        """The heartbeat's part: add output tokens, publish this gateway's in-flight counts, read the
        other gateways', and drop windows older than an hour."""
        output, self._output = self._output, defaultdict(int)
        if output:
            await self.db.executemany(_ADD, [(k, start, tokens) for (k, start), tokens in output.items()])
        async with self.db.transaction() as tx:
            await tx.execute("DELETE FROM key_inflight WHERE gateway = ?", self.gateway_id)
            rows = [(self.gateway_id, k, n) for k, n in inflight.items() if n]
            if rows:
                await tx.executemany("INSERT INTO key_inflight (gateway, key_id, count) VALUES (?, ?, ?)", rows)
        rows = await self.db.fetch(
            "SELECT f.key_id, SUM(f.count) FROM key_inflight f JOIN gateways g ON g.id = f.gateway"
            " WHERE f.gateway <> ? AND g.seen_at > ? GROUP BY f.key_id",
            self.gateway_id,
            time.time() - self.lease_s,
        )
        self.elsewhere = {row[0]: int(row[1]) for row in rows}
        self._spent.clear()
        await self.db.execute("DELETE FROM key_windows WHERE window_start < ?", int(time.time()) - 3600)

    async def forget_gateway(self) -> None:
        await self.db.execute("DELETE FROM key_inflight WHERE gateway = ?", self.gateway_id)
