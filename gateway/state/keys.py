"""Managed API keys: a name, limits and the models a key may use, stored hashed.

A key's secret is ``lp-`` and 32 random bytes (urlsafe base64), shown once when it is made. The
table keeps only its SHA-256. A salted slow hash (bcrypt, argon2) protects low-entropy passwords
from guessing; a 256-bit random secret cannot be guessed, so a plain digest is as safe and costs a
microsecond instead of ~100 ms on every request. The digest's first 32 hex digits are the key's
``owner`` (gateway.state.records.owner_of): its stored responses and usage rows are under it, as for
a ``--api-key`` key.

``KeyStore`` is the table; ``KeyCache`` puts lookups off the database for ``ttl_s`` (a revocation
on another gateway reaches this one within it; on this one, at once).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import asdict, dataclass, field

from gateway.state.db import Database, Row

PREFIX = "lp-"
LIMITS = ("rpm", "tpm", "max_concurrent", "monthly_tokens")
SETTINGS = ("name", *LIMITS, "models", "default_priority")  # what create and update may set
_COLUMNS = (
    "id, name, hash, hint, created_at, revoked_at, rpm, tpm, max_concurrent, monthly_tokens, models, default_priority"
)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(slots=True)
class KeyRecord:
    """One managed key. A limit of None is no limit; ``models`` None is every model."""

    id: str
    name: str
    hash: str
    hint: str  # the secret's first characters, to tell keys apart in a list
    created_at: int
    revoked_at: int | None = None
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens (prompt + output) per minute
    max_concurrent: int | None = None  # generations in flight, across the fleet
    monthly_tokens: int | None = None  # tokens per calendar month (UTC)
    models: list[str] | None = None
    default_priority: int = 0  # a request's priority when it names none (lower is more urgent)
    secret: str | None = field(default=None, repr=False)  # only when just made

    @property
    def owner(self) -> str:
        return self.hash[:32]

    def may_use(self, model: str) -> bool:
        """A model (or adapter, by its served name) this key may ask for and see in /v1/models."""
        return self.models is None or model in self.models

    def view(self) -> dict:
        """The key as /admin/keys shows it: never the hash; the secret only on creation."""
        out = asdict(self)
        del out["hash"]
        if out["secret"] is None:
            del out["secret"]
        out["object"] = "api_key"
        out["status"] = "revoked" if self.revoked_at else "active"
        return out


def _record(row: Row) -> KeyRecord:
    models = json.loads(row[10]) if row[10] is not None else None
    return KeyRecord(*row[:10], models=models, default_priority=int(row[11]))


class KeyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, name: str, **settings: object) -> KeyRecord:
        """A new key; its ``secret`` is set on the record returned and never stored."""
        secret = PREFIX + secrets.token_urlsafe(32)
        if set(settings) - set(SETTINGS):
            raise ValueError(f"a key has no settings {sorted(set(settings) - set(SETTINGS))}")
        key = KeyRecord(f"key_{secrets.token_hex(8)}", name, digest(secret), secret[:8], int(time.time()))
        for setting, value in settings.items():
            setattr(key, setting, value)
        await self.db.execute(
            f"INSERT INTO api_keys ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            key.id,
            key.name,
            key.hash,
            key.hint,
            key.created_at,
            None,
            key.rpm,
            key.tpm,
            key.max_concurrent,
            key.monthly_tokens,
            None if key.models is None else json.dumps(key.models),
            key.default_priority,
        )
        key.secret = secret
        return key

    async def get(self, key_id: str) -> KeyRecord | None:
        row = await self.db.fetchone(f"SELECT {_COLUMNS} FROM api_keys WHERE id = ?", key_id)
        return None if row is None else _record(row)

    async def by_hash(self, key_hash: str) -> KeyRecord | None:
        row = await self.db.fetchone(f"SELECT {_COLUMNS} FROM api_keys WHERE hash = ?", key_hash)
        return None if row is None else _record(row)

    async def list(self) -> list[KeyRecord]:
        return [_record(row) for row in await self.db.fetch(f"SELECT {_COLUMNS} FROM api_keys ORDER BY created_at, id")]

    async def update(self, key_id: str, **settings: object) -> KeyRecord | None:
        """Change a key's name, limits, models or default priority (given ones only)."""
        if set(settings) - set(SETTINGS):
            raise ValueError(f"a key has no settings {sorted(set(settings) - set(SETTINGS))}")
        if settings:
            values = [json.dumps(v) if k == "models" and v is not None else v for k, v in settings.items()]
            sets = ", ".join(f"{k} = ?" for k in settings)
            await self.db.execute(f"UPDATE api_keys SET {sets} WHERE id = ?", *values, key_id)
        return await self.get(key_id)

    async def revoke(self, key_id: str) -> KeyRecord | None:
        """The key stops working on every gateway (within the cache's ttl); its row and usage stay."""
        await self.db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", int(time.time()), key_id
        )
        return await self.get(key_id)


class KeyCache:
    """Lookups by secret, each answer (a key, or none) kept ``ttl_s``; at most ``size`` entries."""

    def __init__(self, store: KeyStore, ttl_s: float, size: int = 10_000) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self.size = size
        self._entries: dict[str, tuple[float, KeyRecord | None]] = {}

    async def lookup(self, secret: str) -> KeyRecord | None:
        """The active key with this secret, or None."""
        if not secret.startswith(PREFIX):
            return None
        key_hash = digest(secret)
        now = time.monotonic()
        entry = self._entries.get(key_hash)
        if entry is None or now - entry[0] > self.ttl_s:
            if len(self._entries) >= self.size:
                self._entries.clear()  # a flood of made-up keys costs lookups, never memory
            entry = self._entries[key_hash] = (now, await self.store.by_hash(key_hash))
        key = entry[1]
        return key if key is not None and key.revoked_at is None else None

    def forget(self, key: KeyRecord | None) -> None:
        if key is not None:
            self._entries.pop(key.hash, None)
