"""Aborts that cross gateways. ``/abort_requests`` names request ids a router gave; in a fleet the
request may run on another gateway. The ids this gateway does not run go into ``aborts``, and each
gateway's heartbeat reads the ones written since its last beat and stops those it runs: the abort
lands a beat later (``--heartbeat-interval``). Rows older than ``KEEP_S`` are deleted."""

from __future__ import annotations

import time

from gateway.state.db import Database

KEEP_S = 60.0
OVERLAP_S = 5.0  # read back this far behind the last beat: another gateway's clock may lag ours


class Aborts:
    def __init__(self, db: Database) -> None:
        self.db = db
        self._since = time.time()
        self._seen: set[str] = set()

    async def post(self, request_ids: list[str]) -> None:
        """Ask every gateway to stop these ids."""
        now = time.time()
        await self.db.executemany(
            "INSERT INTO aborts (id, at) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET at = excluded.at",
            [(request_id, now) for request_id in request_ids],
        )

    async def new(self) -> list[str]:
        """The ids asked to stop since the last call (each once), the old rows forgotten."""
        now = time.time()
        rows = await self.db.fetch("SELECT id, at FROM aborts WHERE at >= ?", self._since - OVERLAP_S)
        fresh = [row[0] for row in rows if row[0] not in self._seen]
        self._seen = {row[0] for row in rows}
        self._since = now
        await self.db.execute("DELETE FROM aborts WHERE at < ?", now - KEEP_S)
        return fresh
