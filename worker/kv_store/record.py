"""What the store keeps for one KV block, and how a reader knows it is whole and meant for it.

A block's key is chained like the prefix cache's hashes (worker/block_manager.py), but with a digest
that is the same in every process and on every machine (Python's ``hash`` is neither: ``hash(None)``
differs between processes), and seeded with the fingerprint: the first block's key digests the
fingerprint and its tokens, each later block's its parent's key and its tokens. Equal keys mean the
same model, dtype, layout and whole prefix; a worker with another fingerprint never asks for them.

A record is a header, the block's token ids, then the payload (the runner's bytes: every layer's K
then V for the block). The header repeats the fingerprint, the key and the lengths, and a CRC-32 of
token ids and payload, so a torn, truncated or bit-flipped record is refused, never used; the token
ids are compared too, so even a digest collision could not serve another prefix's cache.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Iterable, Sequence

MAGIC = b"LLMKVBLK"
FORMAT_VERSION = 1  # bump when the record or the payload's order changes: older stores are not read
KEY_BYTES = 16
_HEADER = struct.Struct("<8sII16s16sIQI")  # magic, version, header size, fingerprint, key, tokens, payload bytes, crc32
HEADER_BYTES = _HEADER.size

Buffer = bytes | bytearray | memoryview


def chain_keys(
    fingerprint: bytes, token_ids: Sequence[int], block_size: int, num_blocks: int, marks: Sequence[bytes] = ()
) -> list[bytes]:
    """The keys of the first ``num_blocks`` full blocks of ``token_ids``; ``marks[i]`` (where given)
    goes into block i's key beside its tokens: the pixel digests of the images it holds tokens of."""
    keys: list[bytes] = []
    parent = fingerprint
    for index in range(num_blocks):
        chunk = token_bytes(token_ids[index * block_size : (index + 1) * block_size])
        if index < len(marks):
            chunk += marks[index]
        parent = hashlib.blake2b(parent + chunk, digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def token_bytes(token_ids: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}I", *token_ids)


def checksum(parts: Iterable[Buffer]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def header(fingerprint: bytes, key: bytes, tokens: bytes, payload: Sequence[Buffer]) -> bytes:
    """The header and token ids that go before ``payload`` (its parts, in order) in a record."""
    size = sum(memoryview(p).nbytes for p in payload)
    crc = checksum([tokens, *payload])
    return _HEADER.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, fingerprint, key, len(tokens) // 4, size, crc) + tokens


def check_header(data: Buffer, fingerprint: bytes, key: bytes, tokens: bytes, payload_bytes: int) -> int | None:
    """The CRC a record with this header must have, or None if the header is not this block's
    (another fingerprint, key, token ids or size; another format; cut short)."""
    if len(data) < HEADER_BYTES + len(tokens):
        return None
    magic, version, size, fp, found_key, num_tokens, payload, crc = _HEADER.unpack_from(data)
    if (magic, version, size, fp, found_key, payload) != (
        MAGIC,
        FORMAT_VERSION,
        HEADER_BYTES,
        fingerprint,
        key,
        payload_bytes,
    ):
        return None
    if num_tokens * 4 != len(tokens) or data[HEADER_BYTES : HEADER_BYTES + len(tokens)] != tokens:
        return None
    return crc


def record_bytes(tokens: bytes) -> int:
    """Header and token ids: where the payload starts."""
    return HEADER_BYTES + len(tokens)
