"""The store's schema, as numbered migrations that every gateway applies at start.

Why not Alembic: it needs SQLAlchemy (an ORM and a second database layer beside the two drivers),
runs synchronously, and takes no lock, so two gateways of a fleet starting together could both
apply the same step. Here each migration is a list of SQL statements (``{blob}`` and ``{real}``
spelled per dialect); ``migrate`` applies the missing ones in order, in one transaction that holds
a lock (PostgreSQL: a transaction-level advisory lock; SQLite: ``BEGIN IMMEDIATE``, the file's write
lock), and records each in ``schema_migrations``. A gateway started against a newer schema than it
knows refuses to run rather than write rows the newer code does not expect.
"""

from __future__ import annotations

import time

from gateway.state.db import Database, Session

_LOCK_ID = 0x6C6C6D706F6F6C  # "llmpool": the advisory lock every gateway takes to migrate

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (
        1,
        "responses, their input items, the event log and token chunks of running ones, gateways' leases, usage",
        [
            """CREATE TABLE responses (
                id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                created_at BIGINT NOT NULL,
                updated_at {real} NOT NULL,
                model TEXT NOT NULL,
                previous_id TEXT,
                conversation_id TEXT,
                status TEXT NOT NULL,
                background INTEGER NOT NULL DEFAULT 0,
                body {blob} NOT NULL,
                input_items {blob} NOT NULL,
                messages {blob} NOT NULL,
                request {blob},
                gateway TEXT,
                cancel INTEGER NOT NULL DEFAULT 0,
                bytes BIGINT NOT NULL DEFAULT 0,
                input_tokens BIGINT NOT NULL DEFAULT 0,
                cached_tokens BIGINT NOT NULL DEFAULT 0,
                output_tokens BIGINT NOT NULL DEFAULT 0,
                reasoning_tokens BIGINT NOT NULL DEFAULT 0
            )""",
            "CREATE INDEX responses_owner_created ON responses (owner, created_at)",
            "CREATE INDEX responses_created ON responses (created_at)",
            "CREATE INDEX responses_running ON responses (status, gateway)",
            # One row per response per group commit: events seq..last_seq, one JSON per line
            "CREATE TABLE response_events (response_id TEXT NOT NULL, seq INTEGER NOT NULL, last_seq INTEGER NOT NULL, data {blob} NOT NULL,"
            " PRIMARY KEY (response_id, seq))",
            # ... and the worker outputs behind them (a msgpack list), for a takeover to replay
            "CREATE TABLE response_chunks (response_id TEXT NOT NULL, seq INTEGER NOT NULL, data {blob} NOT NULL, PRIMARY KEY (response_id, seq))",
            "CREATE TABLE gateways (id TEXT PRIMARY KEY, seen_at {real} NOT NULL)",
            """CREATE TABLE usage (
                day TEXT NOT NULL,
                owner TEXT NOT NULL,
                model TEXT NOT NULL,
                requests BIGINT NOT NULL DEFAULT 0,
                input_tokens BIGINT NOT NULL DEFAULT 0,
                cached_tokens BIGINT NOT NULL DEFAULT 0,
                output_tokens BIGINT NOT NULL DEFAULT 0,
                reasoning_tokens BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (day, owner, model)
            )""",
        ],
    ),
    (
        2,
        "conversations and their items",
        [
            """CREATE TABLE conversations (
                id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                created_at BIGINT NOT NULL,
                metadata {blob} NOT NULL,
                bytes BIGINT NOT NULL DEFAULT 0
            )""",
            """CREATE TABLE conversation_items (
                conversation_id TEXT NOT NULL,
                position BIGINT NOT NULL,
                id TEXT NOT NULL,
                data {blob} NOT NULL,
                PRIMARY KEY (conversation_id, position)
            )""",
            "CREATE INDEX conversation_items_id ON conversation_items (conversation_id, id)",
            "CREATE INDEX conversations_owner_created ON conversations (owner, created_at)",
        ],
    ),
    (
        3,
        "managed API keys (hashed) with their limits, per-minute windows and each gateway's in-flight counts",
        [
            """CREATE TABLE api_keys (
                id TEXT PRIMARY KEY,
                name TEXT NOT NULL,
                hash TEXT NOT NULL UNIQUE,
                hint TEXT NOT NULL,
                created_at BIGINT NOT NULL,
                revoked_at BIGINT,
                rpm BIGINT,
                tpm BIGINT,
                max_concurrent BIGINT,
                monthly_tokens BIGINT,
                models TEXT,
                default_priority INTEGER NOT NULL DEFAULT 0
            )""",
            """CREATE TABLE key_windows (
                key_id TEXT NOT NULL,
                window_start BIGINT NOT NULL,
                requests BIGINT NOT NULL DEFAULT 0,
                tokens BIGINT NOT NULL DEFAULT 0,
                PRIMARY KEY (key_id, window_start)
            )""",
            """CREATE TABLE key_inflight (
                gateway TEXT NOT NULL,
                key_id TEXT NOT NULL,
                count BIGINT NOT NULL,
                PRIMARY KEY (gateway, key_id)
            )""",
        ],
    ),
    (
        4,
        "files (their contents too), batches and their requests (gateway/state/batches.py)",
        [
            """CREATE TABLE files (
                id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                purpose TEXT NOT NULL,
                filename TEXT NOT NULL,
                bytes BIGINT NOT NULL,
                created_at BIGINT NOT NULL,
                content {blob} NOT NULL
            )""",
            "CREATE INDEX files_owner ON files (owner, id)",
            """CREATE TABLE batches (
                id TEXT PRIMARY KEY,
                owner TEXT NOT NULL,
                endpoint TEXT NOT NULL,
                input_file_id TEXT NOT NULL,
                completion_window TEXT NOT NULL,
                status TEXT NOT NULL,
                created_at BIGINT NOT NULL,
                expires_at BIGINT NOT NULL,
                in_progress_at BIGINT,
                finalizing_at BIGINT,
                completed_at BIGINT,
                failed_at BIGINT,
                expired_at BIGINT,
                cancelling_at BIGINT,
                cancelled_at BIGINT,
                output_file_id TEXT,
                error_file_id TEXT,
                errors {blob},
                metadata {blob},
                model TEXT,
                gateway TEXT,
                total BIGINT NOT NULL DEFAULT 0,
                completed BIGINT NOT NULL DEFAULT 0,
                failed BIGINT NOT NULL DEFAULT 0,
                input_tokens BIGINT NOT NULL DEFAULT 0,
                cached_tokens BIGINT NOT NULL DEFAULT 0,
                output_tokens BIGINT NOT NULL DEFAULT 0,
                reasoning_tokens BIGINT NOT NULL DEFAULT 0
            )""",
            "CREATE INDEX batches_owner ON batches (owner, id)",
            "CREATE INDEX batches_status ON batches (status)",
            # state: 0 waiting, 1 claimed by ``gateway``, 2 done (``result``: its output line), 3 cancelled, 4 expired
            """CREATE TABLE batch_requests (
                batch_id TEXT NOT NULL,
                line INTEGER NOT NULL,
                custom_id TEXT NOT NULL,
                body {blob} NOT NULL,
                state INTEGER NOT NULL DEFAULT 0,
                gateway TEXT,
                failed INTEGER NOT NULL DEFAULT 0,
                result {blob},
                PRIMARY KEY (batch_id, line)
            )""",
            "CREATE INDEX batch_requests_state ON batch_requests (batch_id, state)",
            "CREATE INDEX batch_requests_claims ON batch_requests (state, gateway)",
        ],
    ),
    (
        5,
        "LoRA adapters loaded and unloaded at runtime, per model (gateway/state/adapters.py)",
        [
            # path NULL: unloaded (kept, so a worker that rejoins with it is told to drop it)
            """CREATE TABLE lora_adapters (
                model TEXT NOT NULL,
                name TEXT NOT NULL,
                path TEXT,
                updated_at {real} NOT NULL,
                PRIMARY KEY (model, name)
            )""",
        ],
    ),
    (
        6,
        "Request ids /abort_requests asked to stop, for the gateway that runs them (gateway/state/aborts.py)",
        ["CREATE TABLE aborts (id TEXT PRIMARY KEY, at {real} NOT NULL)"],
    ),
]

_TYPES = {
    "sqlite": {"blob": "BLOB", "real": "DOUBLE PRECISION"},
    "postgresql": {"blob": "BYTEA", "real": "DOUBLE PRECISION"},
}


class SchemaTooNew(RuntimeError):
    pass


async def migrate(db: Database) -> list[int]:
    """Bring the schema up to date; the versions applied now (none when it already was)."""
    applied: list[int] = []
    async with db.transaction() as tx:
        if db.dialect == "postgresql":
            await tx.execute("SELECT pg_advisory_xact_lock(?)", _LOCK_ID)
        await tx.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        done = {row[0] for row in await tx.fetch("SELECT version FROM schema_migrations")}
        known = {version for version, _, _ in MIGRATIONS}
        if done - known:
            raise SchemaTooNew(
                f"the state database has schema versions {sorted(done - known)}, newer than this gateway knows: upgrade it"
            )
        for version, _, statements in MIGRATIONS:
            if version not in done:
                await _apply(tx, db.dialect, statements)
                await tx.execute(
                    "INSERT INTO schema_migrations (version, applied_at) VALUES (?, ?)", version, time.time()
                )
                applied.append(version)
    return applied


async def _apply(tx: Session, dialect: str, statements: list[str]) -> None:
    for statement in statements:
        await tx.execute(statement.format(**_TYPES[dialect]))
