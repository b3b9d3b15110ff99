"""Everything that makes a stored KV block valid for a worker, digested into the store's keys.

Two workers share blocks only when all of it is equal: the weights as loaded (a digest of their
bytes, so the same file under another name shares and a fine-tune does not), the model config
(positions, rotary settings), the cache dtype and layout (every layer's K and V block shape), the
block size, the decode weights' quantization (prompt chunks may run through the quantized C++ step),
any adapter, and the record format. Attention kernels and the model implementation are left out on
purpose: in one dtype they compute the same cache, and the exactness tests hold them to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

from worker.kv_store.record import FORMAT_VERSION, KEY_BYTES


@dataclass(frozen=True, slots=True)
class Fingerprint:
    model: str  # the served name: shown to operators, not part of the identity
    weights: str
    config: str
    dtype: str
    layout: str
    block_size: int
    quantization: str
    adapter: str = ""
    format: int = FORMAT_VERSION

    def digest(self) -> bytes:
        identity = {k: v for k, v in dataclasses.asdict(self).items() if k != "model"}
        return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(), digest_size=KEY_BYTES).digest()

    @property
    def hex(self) -> str:
        return self.digest().hex()

    def describe(self) -> dict[str, str | int]:
        return dataclasses.asdict(self)
