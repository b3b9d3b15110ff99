"""Which gateway runs which response, so that another can take over the runs of one that died.

Every gateway renews its lease in ``gateways`` each heartbeat interval; a gateway whose lease is
older than ``lease_s`` (the heartbeat interval x liveness, as for workers) is dead. A running
response names its gateway; taking it over is one conditional UPDATE, so of two gateways that try,
one wins. The same heartbeat reads the cancel requests (POST /cancel on any gateway) for this
gateway's runs.
"""

from __future__ import annotations

import time

from gateway.state.db import Database


class Leases:
    def __init__(self, db: Database, gateway_id: str, lease_s: float) -> None:
        self.db = db
        self.gateway_id = gateway_id
        self.lease_s = lease_s

    async def renew(self) -> None:
        await self.db.execute(
            "INSERT INTO gateways (id, seen_at) VALUES (?, ?) ON CONFLICT (id) DO UPDATE SET seen_at = excluded.seen_at",
            self.gateway_id,
            time.time(),
        )

    async def alive(self, gateway_id: str | None) -> bool:
        if gateway_id is None:
            return False
        if gateway_id == self.gateway_id:
            return True
        row = await self.db.fetchone("SELECT seen_at FROM gateways WHERE id = ?", gateway_id)
        return row is not None and row[0] > time.time() - self.lease_s

    async def claim(self, response_id: str, previous: str | None) -> bool:
        """Make this gateway the one running ``response_id``, if ``previous`` still was (one claim wins)."""
        count = await self.db.execute(
            "UPDATE responses SET gateway = ? WHERE id = ? AND gateway = ? AND status IN ('queued', 'in_progress')",
            self.gateway_id,
            response_id,
            previous,
        )
        return count == 1

    async def orphans(self) -> list[tuple[str, str]]:
        """Background responses whose gateway died: (id, that gateway)."""
        rows = await self.db.fetch(
            "SELECT r.id, r.gateway FROM responses r LEFT JOIN gateways g ON g.id = r.gateway"
            " WHERE r.status IN ('queued', 'in_progress') AND r.background = 1 AND r.gateway <> ? AND (g.id IS NULL OR g.seen_at < ?)",
            self.gateway_id,
            time.time() - self.lease_s,
        )
        return [(row[0], row[1]) for row in rows]

    async def abandoned(self, older_than_s: float) -> list[str]:
        """Plain streams whose gateway died and that no client resumed within ``older_than_s``:
        dropped, as a stream whose client left is (a background one is always taken over)."""
        rows = await self.db.fetch(
            "SELECT r.id FROM responses r LEFT JOIN gateways g ON g.id = r.gateway"
            " WHERE r.status IN ('queued', 'in_progress') AND r.background = 0 AND r.updated_at < ? AND (g.id IS NULL OR g.seen_at < ?)",
            time.time() - older_than_s,
            time.time() - self.lease_s,
        )
        return [row[0] for row in rows]

    async def cancel_requests(self) -> list[str]:
        rows = await self.db.fetch(
            "SELECT id FROM responses WHERE gateway = ? AND cancel = 1 AND status IN ('queued', 'in_progress')",
            self.gateway_id,
        )
        return [row[0] for row in rows]

    async def request_cancel(self, response_id: str, owner: str) -> int:
        return await self.db.execute("UPDATE responses SET cancel = 1 WHERE id = ? AND owner = ?", response_id, owner)

    async def forget_dead(self) -> None:
        """Leases far past their time (a day): their gateways are gone for good."""
        await self.db.execute("DELETE FROM gateways WHERE seen_at < ?", time.time() - 86400)
