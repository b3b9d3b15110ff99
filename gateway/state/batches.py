"""Batches (OpenAI's ``/v1/batches``) and their requests, as rows every gateway of a fleet shares.

A batch's lines become rows of ``batch_requests`` when it leaves ``validating``. A gateway's batch
runner (gateway/batch/runner.py) claims waiting rows in one statement: ``UPDATE ... RETURNING`` over
a ``SELECT ... FOR UPDATE SKIP LOCKED`` on PostgreSQL, so two gateways never claim one row and never
wait on each other's claims; on SQLite the one UPDATE is atomic under the file's write lock. A
result is written only by the gateway that still holds the claim, in the same transaction that
counts it, so a request is in the output once however often gateways die: the claims of a gateway
whose lease ran out (gateway/state/leases.py) go back to waiting and run again elsewhere, and a
result of the old claim, if it ever comes, finds the claim gone. The output and error files are
written in the transaction that ends the batch.

Statuses follow OpenAI's: validating -> in_progress -> finalizing -> completed (or expired past
``expires_at``); validating -> failed (a bad input file); validating / in_progress -> cancelling ->
cancelled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.state.db import Database
from gateway.state.files import Files, new_id

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 86400}
WAITING, CLAIMED, DONE, CANCELLED, EXPIRED = range(5)
USAGE = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")
COLUMNS = (
    "id, owner, endpoint, input_file_id, completion_window, status, created_at, expires_at, "
    + ", ".join(_TIMES)
    + ", output_file_id, error_file_id, errors, metadata, model, total, completed, failed, "
    + ", ".join(USAGE)
)
EXPIRED_ERROR = {
    "code": "batch_expired",
    "message": "This request could not be executed before the completion window expired.",
}


def batch_object(row: Any) -> dict:
    """A row as OpenAI's Batch object."""
    (id_, _, endpoint, input_file, window, status, created, expires), times = row[:8], row[8:15]
    output_file, error_file, errors, metadata, model, total, completed, failed = row[15:23]
    input_tokens, cached, output_tokens, reasoning = (int(v) for v in row[23:27])
    return {
        "id": id_,
        "object": "batch",
        "endpoint": endpoint,
        "errors": msgspec.json.decode(errors) if errors is not None else None,
        "input_file_id": input_file,
        "completion_window": window,
        "status": status,
        "output_file_id": output_file,
        "error_file_id": error_file,
        "created_at": int(created),
        "expires_at": int(expires),
        **{name: None if value is None else int(value) for name, value in zip(_TIMES, times)},
        "request_counts": {"total": int(total), "completed": int(completed), "failed": int(failed)},
        "metadata": msgspec.json.decode(metadata) if metadata is not None else None,
        "model": model,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": input_tokens + output_tokens,
        },
    }


@dataclass(slots=True)
class Claimed:
    """One request of a batch, claimed by this gateway to run."""

    batch_id: str
    owner: str
    endpoint: str
    line: int
    custom_id: str
    body: bytes


class _Lost(Exception):
    """Another gateway changed the batch first: this transaction is rolled back."""


class Batches:
    def __init__(self, db: Database, files: Files, gateway_id: str) -> None:
        self.db = db
        self.files = files
        self.gateway_id = gateway_id

    # ---- the API ---------------------------------------------------------------------------------

    async def create(self, owner: str, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        batch_id, now = new_id("batch_"), int(time.time())
        await self.db.execute(
            "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, created_at, expires_at, metadata)"
            " VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?)",
            batch_id,
            owner,
            endpoint,
            input_file_id,
            window,
            now,
            now + WINDOWS[window],
            None if metadata is None else msgspec.json.encode(metadata),
        )
        return await self.get(batch_id, owner)  # type: ignore[return-value]

    async def get(self, batch_id: str, owner: str | None) -> dict | None:
        sql, args = f"SELECT {COLUMNS} FROM batches WHERE id = ?", [batch_id]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        row = await self.db.fetchone(sql, *args)
        return None if row is None else batch_object(row)

    async def list(self, owner: str | None, limit: int, after: str | None) -> tuple[list[dict], bool]:
        """Newest first (``owner`` None: everyone's, for the dashboard's operator view)."""
        clauses, args = [], []
        if owner is not None:
            clauses, args = ["owner = ?"], [owner]
        if after is not None:
            clauses, args = [*clauses, "id < ?"], [*args, after]
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = await self.db.fetch(f"SELECT {COLUMNS} FROM batches {where} ORDER BY id DESC LIMIT ?", *args, limit + 1)
        return [batch_object(row) for row in rows[:limit]], len(rows) > limit

    async def cancel(self, batch_id: str, owner: str) -> dict | None:
        await self.db.execute(
            "UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND owner = ?"
            " AND status IN ('validating', 'in_progress')",
            int(time.time()),
            batch_id,
            owner,
        )
        return await self.get(batch_id, owner)

    # ---- the runners' side -----------------------------------------------------------------------

    async def validating(self) -> list[tuple[str, str, str, str]]:
        """(id, owner, input file, endpoint) of the batches whose lines are still to check."""
        rows = await self.db.fetch(
            "SELECT id, owner, input_file_id, endpoint FROM batches WHERE status = 'validating' ORDER BY id LIMIT 16"
        )
        return [(r[0], r[1], r[2], r[3]) for r in rows]

    async def start(self, batch_id: str, lines: list[tuple[str, bytes]], errors: list[dict], model: str | None) -> bool:
        """Out of ``validating``: in progress with its lines as requests, or failed with ``errors``
        (OpenAI's shape). False when another gateway did it first (or the batch was cancelled)."""
        now = int(time.time())
        try:
            async with self.db.transaction() as tx:
                if errors:
                    sql, args = (
                        "status = 'failed', failed_at = ?, errors = ?",
                        [now, msgspec.json.encode({"object": "list", "data": errors})],
                    )
                else:
                    sql, args = (
                        "status = 'in_progress', in_progress_at = ?, total = ?, model = ?",
                        [now, len(lines), model],
                    )
                if (
                    await tx.execute(
                        f"UPDATE batches SET {sql} WHERE id = ? AND status = 'validating'", *args, batch_id
                    )
                    != 1
                ):
                    raise _Lost
                if not errors:
                    await tx.executemany(
                        "INSERT INTO batch_requests (batch_id, line, custom_id, body) VALUES (?, ?, ?, ?)",
                        [(batch_id, i, custom_id, body) for i, (custom_id, body) in enumerate(lines)],
                    )
        except _Lost:
            return False
        return True

    async def active(self) -> list[tuple[str, str, str, str, int]]:
        """(id, owner, endpoint, status, expires_at) of the batches that still run or end, oldest first."""
        rows = await self.db.fetch(
            "SELECT id, owner, endpoint, status, expires_at, gateway FROM batches"
            " WHERE status IN ('in_progress', 'cancelling', 'finalizing') ORDER BY id"
        )
        return [(r[0], r[1], r[2], r[3], int(r[4])) for r in rows]

    async def claim(self, batch_id: str, owner: str, endpoint: str, count: int) -> list[Claimed]:
        """Up to ``count`` waiting requests of the batch, now this gateway's, in line order."""
        pick = "SELECT line FROM batch_requests WHERE batch_id = ? AND state = 0 ORDER BY line LIMIT ?"
        if self.db.dialect == "postgresql":
            pick += " FOR UPDATE SKIP LOCKED"
        rows = await self.db.fetch(
            f"UPDATE batch_requests SET state = 1, gateway = ? WHERE batch_id = ? AND line IN ({pick})"
            " RETURNING line, custom_id, body",
            self.gateway_id,
            batch_id,
            batch_id,
            count,
        )
        return sorted(
            (Claimed(batch_id, owner, endpoint, int(r[0]), r[1], bytes(r[2])) for r in rows), key=lambda c: c.line
        )

    async def finish(self, claimed: Claimed, result: bytes, failed: bool, usage: tuple[int, int, int, int]) -> bool:
        """Write a request's output line and count it, if this gateway still holds its claim."""
        try:
            async with self.db.transaction() as tx:
                if (
                    await tx.execute(
                        "UPDATE batch_requests SET state = 2, result = ?, failed = ?, body = ? WHERE batch_id = ? AND line = ?"
                        " AND state = 1 AND gateway = ?",
                        result,
                        int(failed),
                        b"",
                        claimed.batch_id,
                        claimed.line,
                        self.gateway_id,
                    )
                    != 1
                ):
                    raise _Lost
                await tx.execute(
                    "UPDATE batches SET completed = completed + ?, failed = failed + ?, "
                    + ", ".join(f"{name} = {name} + ?" for name in USAGE)
                    + " WHERE id = ?",
                    int(not failed),
                    int(failed),
                    *usage,
                    claimed.batch_id,
                )
        except _Lost:
            return False
        return True

    async def release(self, claimed: Claimed, state: int = WAITING) -> None:
        """Give a claim back: to run later (a transient failure), or as cancelled."""
        await self.db.execute(
            "UPDATE batch_requests SET state = ?, gateway = NULL WHERE batch_id = ? AND line = ? AND state = 1 AND gateway = ?",
            state,
            claimed.batch_id,
            claimed.line,
            self.gateway_id,
        )

    async def reclaim(self, lease_s: float) -> int:
        """Claims of gateways whose lease ran out go back to waiting."""
        return await self.db.execute(
            "UPDATE batch_requests SET state = 0, gateway = NULL WHERE state = 1 AND gateway <> ?"
            " AND gateway NOT IN (SELECT id FROM gateways WHERE seen_at >= ?)",
            self.gateway_id,
            time.time() - lease_s,
        )

    async def stop_waiting(self, batch_id: str, state: int) -> int:
        """Waiting requests that will not run (cancelled, expired)."""
        return await self.db.execute(
            "UPDATE batch_requests SET state = ? WHERE batch_id = ? AND state = 0", state, batch_id
        )

    async def unfinished(self, batch_id: str) -> int:
        row = await self.db.fetchone("SELECT COUNT(*) FROM batch_requests WHERE batch_id = ? AND state < 2", batch_id)
        return int(row[0]) if row else 0

    async def finalize(self, batch_id: str, status: str, lease_s: float) -> bool:
        """End the batch as ``status`` (completed, expired, cancelled): its output and error files,
        its rows gone. In progress passes through finalizing (owned by this gateway, or taken over
        from one whose lease ran out); cancelling ends at once. False when another gateway did it."""
        now = int(time.time())
        came_from = "cancelling" if status == "cancelled" else "finalizing"
        if came_from == "finalizing":
            moved = await self.db.execute(
                "UPDATE batches SET status = 'finalizing', finalizing_at = COALESCE(finalizing_at, ?), gateway = ?"
                " WHERE id = ? AND (status = 'in_progress' OR (status = 'finalizing' AND (gateway IS NULL OR gateway"
                " NOT IN (SELECT id FROM gateways WHERE seen_at >= ?))))",
                now,
                self.gateway_id,
                batch_id,
                time.time() - lease_s,
            )
            if moved != 1:
                return False
        # Nothing changes the rows now: a batch is ended only once none of its requests runs or
        # waits. The files' bytes go to the file store before the transaction that lists them.
        rows = await self.db.fetch(
            "SELECT custom_id, state, failed, result FROM batch_requests WHERE batch_id = ? AND state IN (2, 4)"
            " ORDER BY line",
            batch_id,
        )
        owner_row = await self.db.fetchone("SELECT owner FROM batches WHERE id = ?", batch_id)
        if owner_row is None:
            return False
        staged = [await self.files.stage(b"".join(lines)) if lines else None for lines in _split(rows)]
        try:
            async with self.db.transaction() as tx:
                for made, kind in zip(staged, ("output", "error")):
                    if made is not None:
                        await self.files.insert(made, owner_row[0], "batch_output", f"{batch_id}_{kind}.jsonl", tx)
                ids = [None if made is None else made.id for made in staged]
                sql = f"UPDATE batches SET status = ?, {status}_at = ?, output_file_id = ?, error_file_id = ? WHERE id = ? AND status = ?"
                args: list[object] = [status, now, *ids, batch_id, came_from]
                if came_from == "finalizing":
                    sql, args = sql + " AND gateway = ?", [*args, self.gateway_id]
                if await tx.execute(sql, *args) != 1:
                    raise _Lost
                await tx.execute("DELETE FROM batch_requests WHERE batch_id = ?", batch_id)
        except BaseException as exc:
            for made in filter(None, staged):
                await self.files.discard(made)
            if isinstance(exc, _Lost):
                return False
            raise
        return True

    async def usage(self, batch_id: str | None = None) -> list[dict]:
        """Tokens per batch for ``/v1/usage?batch=...`` (``*``: every batch)."""
        sql = "SELECT id, owner, model, status, completed, failed, " + ", ".join(USAGE) + " FROM batches"
        rows = await self.db.fetch(
            sql + (" WHERE id = ?" if batch_id else "") + " ORDER BY id", *([batch_id] if batch_id else [])
        )
        return [
            {
                "batch": r[0],
                "owner": r[1],
                "model": r[2],
                "status": r[3],
                "requests": int(r[4]) + int(r[5]),
                **{name: int(value) for name, value in zip(USAGE, r[6:])},
            }
            for r in rows
        ]


def _split(rows: list[Any]) -> tuple[list[bytes], list[bytes]]:
    """Output lines (succeeded) and error lines (failed, or never run before the batch expired)."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for custom_id, state, failed, result in rows:
        if state == EXPIRED:
            line = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": None, "error": EXPIRED_ERROR}
            errors.append(msgspec.json.encode(line) + b"\n")
        else:
            (errors if failed else output).append(bytes(result) + b"\n")
    return output, errors
