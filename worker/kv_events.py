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

Replay (``--kv-events-replay-endpoint``, off by default): the last ``REPLAY_BATCHES`` batches stay
in a ring, and a ROUTER socket (always bound) answers a subscriber that joined late or missed
sequence numbers, with vLLM's framing: the request is ``[b"", seq]`` (a REQ socket adds the empty
frame; a DEALER sends it), the answer one ``[b"", seq, payload]`` per batch from ``seq`` on, then
``[b"", -1, b""]`` (8 bytes each, big-endian, -1 signed). The ROUTER has a thread of its own, so a
replay is answered while the engine is idle; it shares only the ring, under a lock.

zmq lives here, beside the other socket modules (tests/test_layout.py lists it): the block manager
only calls ``stored`` / ``removed`` on whatever sink it was given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
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
REPLAY_BATCHES = 10_000  # batches kept for replay (vLLM's buffer_steps default)
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # closes a replay's answer


class KvEventPublisher:
    """Collects the block manager's events and sends them once per step (``flush``, on the engine
    thread, which also opens the socket, so only that thread ever touches it)."""

    def __init__(self, endpoint: str, topic: str = "", hwm: int = 100_000, replay_endpoint: str | None = None) -> None:
        self.endpoint, self.topic, self.hwm = endpoint, topic.encode(), hwm
        self.pending: list[Any] = [AllBlocksCleared()]
        self.seq = 0
        self.dropped = 0
        self._socket: zmq.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self.replay = Replay(replay_endpoint) if replay_endpoint else None

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
        if self.replay is not None:
            self.replay.keep(self.seq, payload)  # kept even when the PUB queue drops it: that is what replay is for
        try:
            self._open().send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("KV events: the send queue to %s is full; dropping batches", self.endpoint)
        self.seq += 1

    def start(self) -> None:
        """Open the socket now (on the engine thread, before the first step), so subscribers that
        connect while the worker registers get every batch from the first, ``AllBlocksCleared``;
        and the replay socket's thread, which raises here when its endpoint cannot be bound."""
        self._open()
        if self.replay is not None:
            self.replay.start()

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
        if self.replay is not None:
            self.replay.stop()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


class Replay:
    """The ring of recent batches and the ROUTER socket that answers replay requests from it, on a
    thread that alone touches that socket (the engine thread only calls ``keep``)."""

    def __init__(self, endpoint: str, size: int = REPLAY_BATCHES) -> None:
        self.endpoint = endpoint
        self.ring: deque[tuple[int, bytes]] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._failed: Exception | None = None
        self._thread: threading.Thread | None = None

    def keep(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self.ring.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The kept batches from ``start`` on (from the oldest kept when ``start`` is older: a
        subscriber sees the gap in the first sequence number it gets)."""
        with self._lock:
            return [(seq, payload) for seq, payload in self.ring if seq >= start]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="kv-events-replay", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _serve(self) -> None:
        socket = zmq.Context.instance().socket(zmq.ROUTER)
        # A whole ring's answer fits the queue: a ROUTER drops what goes over it, silently.
        socket.set_hwm(self.ring.maxlen + 2)
        try:
            socket.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self._failed = ValueError(f"--kv-events-replay-endpoint {self.endpoint}: {exc}")
            socket.close(linger=0)
            self._ready.set()
            return
        log.info("KV events replayed on %s", self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if socket.poll(200):
                    self._answer(socket, socket.recv_multipart())
        finally:
            socket.close(linger=0)

    def _answer(self, socket: zmq.Socket, frames: list[bytes]) -> None:
        """Send the batches a request asks for, then the end marker; a malformed request gets the end
        marker alone (vLLM answers it nothing, which leaves a REQ client waiting forever)."""
        client = frames[0]
        if len(frames) == 3 and not frames[1] and len(frames[2]) == 8:
            for seq, payload in self.since(int.from_bytes(frames[2], "big")):
                socket.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        else:
            log.warning("KV events: a malformed replay request (%d frames)", len(frames))
        socket.send_multipart((client, b"", END_SEQ, b""))
