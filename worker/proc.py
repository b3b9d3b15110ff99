"""The worker process's socket side: a DEALER connected to the gateway, wrapped around the engine.

The loop schedules its own steps (no round trip to the gateway per token): drain whatever arrived,
run one engine step, send one StepOutputs for the whole batch, heartbeat when due. Any message from
the gateway counts as its heartbeat; when it has been silent for ``liveness`` intervals the worker
drops what it was doing (the gateway has moved those requests already), reconnects with backoff
from 1 s to 32 s and registers again, so workers survive gateway restarts.

SIGTERM (or SIGINT) drains: the worker tells the gateway at once (``draining`` in its heartbeat),
finishes what it holds, then says Goodbye and exits. A second signal, or ``drain_timeout``, ends the
drain early; the gateway then moves the requests that were left to other workers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import uuid
from collections import deque

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from common import protocol
from common.protocol import Abort, AddRequests, Goodbye, Heartbeat, Ready, StepOutputs
from worker.engine import Engine

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 32.0


class WorkerProc:
    """Connects, registers, and runs the engine loop until told to stop."""

    def __init__(
        self,
        engine: Engine,
        address: str,
        name: str | None,
        model: str,
        device: str,
        dtype: str,
        heartbeat_interval: float,
        heartbeat_liveness: int,
        drain_timeout: float = 30.0,
        curve_keys: tuple[str, str] | None = None,
    ) -> None:
        self.curve_keys = curve_keys  # (own secret key file, gateway public key file)
        self.engine = engine
        self.address = address
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.ready = Ready(
            worker_name=self.name,
            model=model,
            max_model_len=engine.max_model_len,
            kv_capacity_tokens=engine.blocks.capacity_tokens,
            block_size=engine.blocks.block_size,
            max_batch_size=engine.max_num_seqs,
            device=device,
            dtype=dtype,
        )
        self.interval = heartbeat_interval
        self.liveness = heartbeat_liveness
        self.context = zmq.Context.instance()
        self.stopping = False
        self.drain_timeout = drain_timeout
        self.draining_since: float | None = None
        self._announced_drain = False
        self._unsent: deque[list[bytes]] = deque()  # messages the socket could not take yet, in order

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.drain())

    def drain(self) -> None:
        """First call: finish the current requests, take no new ones, then leave. Second: leave now."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()
            load = self.engine.load()
            log.info("draining: finishing %d requests, taking no new ones", load.running + load.waiting)
        else:
            self.stopping = True

    def run(self) -> None:
        """Connect, serve until the gateway goes silent, reconnect with backoff; until stopped."""
        backoff = 1.0
        while not self.stopping:
            sock = self._connect()
            try:
                heard = self._serve(sock)
            finally:
                if self.stopping:
                    self._send(sock, Goodbye("shutting down"))
                self._close(sock, linger=500 if self.stopping else 0)
            dropped = self.engine.fail_all("worker lost its gateway")
            if dropped:
                log.warning("gateway silent: dropped %d requests", len(dropped))
            if self.stopping:
                break
            backoff = 1.0 if heard else backoff
            log.info("reconnecting to %s in %.0f s", self.address, backoff)
            self._sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _connect(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        # A fresh identity per connection: the gateway may still hold the old one until it expires.
        sock.setsockopt(zmq.IDENTITY, f"{self.name}/{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.curve_keys:
            own_public, own_secret = zmq.auth.load_certificate(self.curve_keys[0])
            server_public, _ = zmq.auth.load_certificate(self.curve_keys[1])
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = own_public, own_secret, server_public
        self._monitor = sock.get_monitor_socket(protocol.HANDSHAKE_EVENT_MASK)
        self._handshakes_seen: set[int] = set()
        sock.connect(self.address)
        self._unsent.clear()  # meant for the old connection; the gateway resumes those requests itself
        self._send(sock, self.ready)
        log.info("connecting to the gateway at %s as %s", self.address, self.name)
        return sock

    def _read_monitor(self) -> None:
        """Say how the handshake went, once per outcome and connection (zmq retries every 100 ms)."""
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in self._handshakes_seen:
                continue
            self._handshakes_seen.add(event)
            outcome = protocol.HANDSHAKE_EVENTS.get(event, str(event))
            if event == protocol.HANDSHAKE_SUCCEEDED:
                log.debug("handshake with the gateway at %s %s", self.address, outcome)
            else:
                log.error("handshake with the gateway at %s %s", self.address, outcome)

    def _close(self, sock: zmq.Socket, linger: int) -> None:
        sock.disable_monitor()
        self._monitor.close(linger=0)
        sock.close(linger=linger)

    def _serve(self, sock: zmq.Socket) -> bool:
        """The step loop. Returns whether the gateway ever answered (to reset the backoff)."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        last_heard = time.monotonic()
        heard = False
        next_heartbeat = 0.0
        self._announced_drain = False
        while not self.stopping:
            self._flush(sock)
            now = time.monotonic()
            wait_s = 0.0 if self.engine.has_work() else max(0.0, min(next_heartbeat - now, self.interval))
            if self._unsent:
                wait_s = min(wait_s, 0.01)
            if poller.poll(int(wait_s * 1000)):
                self._read_monitor()
                if self._drain(sock):
                    if not heard:  # the gateway only talks to workers it registered
                        log.info("registered with the gateway at %s as %s", self.address, self.name)
                    last_heard, heard = time.monotonic(), True
            if self.engine.has_work():
                self._send(sock, self._step())
            now = time.monotonic()
            if self.draining_since is not None:
                if not self.engine.has_work() or now - self.draining_since > self.drain_timeout:
                    self.stopping = True
                    return heard
                if not self._announced_drain:
                    self._announced_drain, next_heartbeat = True, now  # tell the gateway right away
            if now >= next_heartbeat:
                load = self.engine.load()
                load.draining = self.draining_since is not None
                self._send(sock, load)
                next_heartbeat = now + self.interval
            if now - last_heard > self.interval * self.liveness:
                log.warning("no word from the gateway for %.1f s", now - last_heard)
                return heard
        return heard

    def _step(self) -> StepOutputs:
        try:
            return self.engine.step()
        except Exception as exc:  # a failed step must not kill the worker or leak blocks
            log.exception("step failed")
            return StepOutputs(self.engine.fail_all(f"step failed: {type(exc).__name__}: {exc}"))

    def _drain(self, sock: zmq.Socket) -> bool:
        """Handle every message waiting on the socket; True if anything valid arrived."""
        got = False
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as exc:
                msg = self._salvage(frames, exc)
                if msg is None:
                    continue
            got = True
            if isinstance(msg, AddRequests):
                for new in msg.requests:
                    self.engine.add_request(new)
            elif isinstance(msg, Abort):
                self._send(sock, StepOutputs(self.engine.abort(msg.request_ids)))
            elif not isinstance(msg, Heartbeat):
                log.warning("unexpected %s from the gateway", type(msg).__name__)

    def _salvage(self, frames: list[bytes], exc: protocol.ProtocolError) -> AddRequests | None:
        """A message that did not decode: if it is an AddRequests, keep the requests that do decode
        and answer the others with an error (the gateway would otherwise wait on them until its
        timeout); anything else is dropped."""
        salvaged = protocol.salvage_requests(frames)
        if salvaged is None:
            log.warning("dropped a malformed message: %s", exc)
            return None
        good, bad = salvaged
        log.warning("an AddRequests did not decode (%s): %d of its requests run, %d are refused", exc, len(good), len(bad))
        for request_id, why in bad:
            self.engine.reject(request_id, why, bad_request=True)
        return AddRequests(good)

    def _send(self, sock: zmq.Socket, msg: protocol.Message) -> None:
        """Never block the step loop on a slow gateway, and never lose a message either (a lost
        output is a gap in a stream): what the socket can't take now waits for the next try."""
        if not self._unsent:
            try:
                sock.send_multipart(protocol.encode(msg), zmq.NOBLOCK)
                return
            except zmq.Again:
                log.warning("gateway not accepting messages; holding them until it does")
        self._unsent.append(protocol.encode(msg))

    def _flush(self, sock: zmq.Socket) -> None:
        """Send what was held back, oldest first, as far as the socket takes it."""
        while self._unsent:
            try:
                sock.send_multipart(self._unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self._unsent.popleft()

    def _sleep(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stopping and time.monotonic() < deadline:
            time.sleep(0.1)
