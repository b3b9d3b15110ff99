"""The runner's side of the KV store (worker/kv_store): a block's bytes out of the paged cache and
back in, and the digest of the weights that goes into the store's fingerprint.

A block's payload is every layer's K block then its V block, ``[block_size, kv_heads, head_dim]``
each, as raw bytes in the cache's dtype. The writer thread reads blocks through NumPy views made
here once (no torch call on that thread: torch would start a second OpenMP team beside the engine
thread's, which slows every step, see worker/stepper.py); loads are copied in on the engine thread,
one NumPy row scatter per layer and side. On a GPU the same two methods would copy through pinned
host memory (the host-RAM tier) on a side stream; this class is the CPU's.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch

from worker.runner.kv_cache import KVCaches

log = logging.getLogger(__name__)


class CpuBlockIO:
    """Blocks of CPU-resident caches as bytes (shapes per layer, so layers may differ)."""

    def __init__(self, kv_caches: KVCaches) -> None:
        if kv_caches[0][0].device.type != "cpu":
            raise ValueError("the KV store reads and writes CPU caches only (a GPU worker needs a host-RAM tier first)")
        # Per layer and side, the cache as [blocks, bytes] in NumPy (the same memory).
        self._arrays = [side.view(side.shape[0], -1).view(torch.uint8).numpy() for pair in kv_caches for side in pair]
        self._sizes = [array.shape[1] for array in self._arrays]
        self.payload_bytes = sum(self._sizes)
        self.dtype = str(kv_caches[0][0].dtype).removeprefix("torch.")
        self.layout = "per layer K then V, each [block, token, kv_head, dim]: " + ", ".join(
            "x".join(map(str, side.shape[1:])) for pair in kv_caches for side in pair
        )

    def block_parts(self, block_id: int) -> list[memoryview]:
        """The block's payload as views into the cache (valid while the block is pinned)."""
        return [memoryview(array[block_id]) for array in self._arrays]

    def copy_in(self, block_ids: list[int], staged: memoryview) -> None:
        """Write ``len(block_ids)`` payloads, back to back in ``staged``, into those blocks: one
        NumPy row scatter per layer and side (torch's uint8 ``index_copy_`` was 120x slower: 14.7 ms
        against 0.12 ms per layer and side for a 4,096-token prompt)."""
        count = len(block_ids)
        source = np.frombuffer(staged, dtype=np.uint8, count=count * self.payload_bytes).reshape(
            count, self.payload_bytes
        )
        index = np.asarray(block_ids, dtype=np.intp)
        offset = 0
        for array, size in zip(self._arrays, self._sizes):
            array[index] = source[:, offset : offset + size]
            offset += size


def weights_digest(model: torch.nn.Module, cache: Path | None) -> str:
    """A digest of every weight's name, dtype, shape and bytes as loaded (the identity of the weights,
    whatever file or name they came under), kept in ``cache`` when given: hashing the default model
    takes about 0.3 s, a 7B model a minute."""
    if cache is not None and cache.is_file():
        return cache.read_text().strip()
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}".encode())
        digest.update(data.view(-1).view(torch.uint8).numpy().data if data.numel() else b"")
    found = digest.hexdigest()
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            temp = cache.with_suffix(".tmp")
            temp.write_text(found + "\n")
            temp.replace(cache)
        except OSError as exc:
            log.warning("could not cache the weights digest in %s: %s", cache, exc)
    return found
