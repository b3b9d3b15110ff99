"""What the store keeps of a response, and whose it is."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def owner_of(key: str | None) -> str:
    """The owner of what a caller stores: a digest of its API key (never the key itself), or '' on a
    server without keys. Responses and conversations are scoped to it, as OpenAI scopes them to a project."""
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def key_label(owner: str) -> str:
    """The short, hashed form of a key that metrics and /v1/usage show ('-' for no key)."""
    return owner[:12] or "-"


@dataclass(slots=True)
class ResponseRecord:
    """One response row. ``body`` is the response object as GET returns it (JSON); ``input_items``
    its own input items, with ids (JSON list); ``messages`` this turn's chat messages, input then
    output (JSON list): a continuation's history is its chain of ``previous_id``'s messages."""

    id: str
    owner: str
    created_at: int
    model: str
    status: str
    body: bytes
    input_items: bytes
    messages: bytes
    previous_id: str | None = None
    conversation_id: str | None = None
    background: bool = False
    request: bytes | None = None  # while it runs: what another gateway needs to take it over
    gateway: str | None = None  # while it runs: the gateway running it
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    extra_bytes: int = 0  # its event log's bytes, counted in its budget

    @property
    def bytes(self) -> int:
        return len(self.body) + len(self.input_items) + len(self.messages) + self.extra_bytes

    def row(self, now: float) -> tuple:
        return (
            self.id,
            self.owner,
            self.created_at,
            now,
            self.model,
            self.previous_id,
            self.conversation_id,
            self.status,
            int(self.background),
            self.body,
            self.input_items,
            self.messages,
            self.request,
            self.gateway,
            self.bytes,
            self.input_tokens,
            self.cached_tokens,
            self.output_tokens,
            self.reasoning_tokens,
        )


COLUMNS = (
    "id, owner, created_at, updated_at, model, previous_id, conversation_id, status, background, body, input_items, messages, request, "
    "gateway, bytes, input_tokens, cached_tokens, output_tokens, reasoning_tokens"
)
INSERT = f"INSERT INTO responses ({COLUMNS}) VALUES ({', '.join('?' * len(COLUMNS.split(', ')))})"
# The final write: everything but who created it and when.
UPSERT = (
    INSERT
    + " ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at, status = excluded.status, body = excluded.body,"
    " input_items = excluded.input_items, messages = excluded.messages, request = NULL, gateway = NULL, bytes = excluded.bytes,"
    " input_tokens = excluded.input_tokens, cached_tokens = excluded.cached_tokens, output_tokens = excluded.output_tokens,"
    " reasoning_tokens = excluded.reasoning_tokens"
)


@dataclass(slots=True)
class StoredResponse:
    """A row as reads see it."""

    id: str
    status: str
    body: bytes
    background: bool
    gateway: str | None
    request: bytes | None
    previous_id: str | None
    conversation_id: str | None
    model: str
    created_at: int
    owner: str = ""

    @property
    def running(self) -> bool:
        return self.status not in TERMINAL


READ_COLUMNS = "id, status, body, background, gateway, request, previous_id, conversation_id, model, created_at, owner"


def stored(row) -> StoredResponse:  # a database row
    return StoredResponse(
        row[0], row[1], bytes(row[2]), bool(row[3]), row[4], None if row[5] is None else bytes(row[5]), *row[6:11]
    )
