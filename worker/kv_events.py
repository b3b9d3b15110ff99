"""KV-cache events on a ZeroMQ PUB socket, in vLLM's schema (``vllm/distributed/kv_events.py``), so
llm-d's precise prefix routing and Dynamo's KV router can follow this worker's prefix cache
(``--kv-events-endpoint``, off by default).

Each step's events go out as one ``KVEventBatch`` (msgpack, a timestamp and the events) in a
three-part message: the topic, an 8-byte big-endian sequence number, the payload. ``BlockStored``
names the blocks the prefix cache registered (chained hashes, as worker/block_manager.py computes
them: each from its parent's and its tokens, the first from the request's salt), ``BlockRemoved``
those it dropped, and ``AllBlocksCleared`` opens the stream (whatever a subscriber held is gone).
The endpoint binds when it has a wildcard (``tcp://*:5557``) or is ipc://, else it connects to a
subscriber that bound, as vLLM's publisher does; several workers of one host need one port each,
or connect to one bound subscriber. A full send queue drops batches rather than stall a step.

zmq lives here, beside the other socket modules (tests/test_layout.py lists it): the block manager
only calls ``stored`` / ``removed`` on whatever sink it was given.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
import zmq

log = logging.getLogger(__name__)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, tag=True):
    """vLLM's base: each event is tagged with its class name (``type``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


MEDIUM = "GPU"  # vLLM's name for the worker's own KV cache, whatever the device


class KvEventPublisher:
    """Collects the block manager's events and sends them once per step (``flush``, on the engine
    thread, which also opens the socket, so only that thread ever touches it)."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 100_000) -> None:
        self.endpoint, self.topic, self.hwm = endpoint, topic.encode(), hwm
        self.pending: list[Any] = [AllBlocksCleared()]
        self.seq = 0
        self.dropped = 0
        self._socket: zmq.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()

    def stored(
        self, block_hash: int, parent: int | None, token_ids: tuple[int, ...], block_size: int, lora: str | None
    ) -> None:
        self.pending.append(BlockStored([block_hash], parent, list(token_ids), block_size, None, MEDIUM, lora))

    def removed(self, block_hash: int) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved([block_hash], MEDIUM))

    def flush(self) -> None:
        """Send the events since the last flush as one batch (nothing when there are none)."""
        if not self.pending:
            return
        batch, self.pending = KVEventBatch(time.time(), self.pending), []
        payload = self._encoder.encode(batch)
        try:
            self._open().send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the send queue to %s is full; dropping batches", self.endpoint)
        self.seq += 1

    def start(self) -> None:
        """Open the socket now (on the engine thread, before the first step), so subscribers that
        connect while the worker registers get every batch from the first, ``AllBlocksCleared``."""
        self._open()

    def _open(self) -> zmq.Socket:
        if self._socket is None:
            self._socket = zmq.Context.instance().socket(zmq.PUB)
            self._socket.set_hwm(self.hwm)
            if "*" in self.endpoint or "::" in self.endpoint or self.endpoint.startswith(("ipc://", "inproc://")):
                self._socket.bind(self.endpoint)
            else:
                self._socket.connect(self.endpoint)
            log.info("KV events published on %s", self.endpoint)
        return self._socket

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
