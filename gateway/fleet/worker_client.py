"""The gateway's ROUTER socket: it binds, reads every worker's messages and hands them, decoded, to
dispatch (gateway/fleet/dispatch.py, which decides everything and holds no socket), then sends what
dispatch decided. It also keeps the heartbeat clock, loads the tokenizers that new models' workers
send, and refuses (in words the worker can read) a worker of another protocol version.

ROUTER_MANDATORY makes a send to a worker that is gone fail loudly: that worker is purged. One
receive task reads every worker; submits made in the same event-loop tick travel to a worker in
one ``AddRequests`` message.

The ROUTER is a plain socket read on the event loop's own reader, not a zmq.asyncio one: at one
stream every token is a message, and zmq.asyncio's futures, retried reads and flag enums cost
0.12 ms of the gateway's 0.65 ms of CPU per token (on the 2-core machines, CPU the worker's step
team waits for). zmq's FD only says that something changed, and any send may take that signal,
so the socket's own EVENTS decide: the receive task reads while they say POLLIN, and each send
wakes it when they do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
import zmq.auth
import zmq.auth.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from common import protocol
from common.protocol import LoraResult, ModelInfo, MsgType, NewRequest
from gateway.fleet.dispatch import Dispatcher
from gateway.fleet.lora import LoraCommands
from gateway.fleet.roster import GATEWAY_HEARTBEAT
from gateway.fleet.workers import UNTRACED, ModelPool, RequestStream, Trace, WorkerInfo

log = logging.getLogger(__name__)

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: flag enums cost microseconds a test
_HEARTBEAT = protocol.encode(GATEWAY_HEARTBEAT)  # the gateway's heartbeat carries nothing: encode it once


class WorkerClient:
    """Owns the ROUTER socket; ``submit`` and ``abort`` are the gateway's only ways to reach workers."""

    def __init__(
        self,
        bind_address: str,
        heartbeat_interval: float,
        heartbeat_liveness: int,
        max_retries: int = 2,
        hung_timeout: float = 60.0,
        affinity_slack: int | None = 2048,
        curve_secret_key: str | None = None,
        curve_authorized_keys: str | None = None,
        learn_model: Callable[[ModelInfo], Awaitable[None]] | None = None,
    ) -> None:
        """``learn_model`` loads a model's tokenizer from a worker's ModelInfo (raises if it can't);
        None: take a model's digest on trust (unit tests of the socket side, the fleet benchmark)."""
        self.bind_address = bind_address
        self.interval = heartbeat_interval
        self.curve_secret_key = curve_secret_key
        self.curve_authorized_keys = curve_authorized_keys
        self.dispatch = Dispatcher(
            heartbeat_interval, heartbeat_liveness, max_retries, hung_timeout, affinity_slack, reachable=self._reachable
        )
        self.learn_model = learn_model
        self.dropped_frames = 0
        self._authenticator: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self._context = zmq.asyncio.Context()  # asyncio for the CURVE authenticator and the handshake monitor
        self._socket: zmq.Socket | None = None  # plain: read on the event loop's reader (module docstring)
        self._readable = asyncio.Event()  # zmq's FD fired, or a send found messages waiting
        self._tasks: list[asyncio.Task] = []
        self._flush_scheduled = False
        self._busy = asyncio.Event()  # set when a request arrives: ends the receive loop's idle pause
        self.loras = LoraCommands(self.send)  # load and unload commands for LoRA adapters, and their answers

    async def start(self) -> None:
        sock = zmq.Socket(self._context, zmq.ROUTER)
        if self.curve_secret_key:
            self._enable_curve(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.bind_address)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._heartbeat_loop())]
        if self.curve_secret_key:
            self._tasks.append(
                asyncio.create_task(self._watch_handshakes(sock.get_monitor_socket(protocol.HANDSHAKE_EVENT_MASK)))
            )
        log.info("waiting for workers on %s", self.bind_address)

    def _enable_curve(self, sock: zmq.Socket) -> None:
        """CURVE: traffic is encrypted, and only workers whose public key is in the authorized folder
        can connect (a ZAP authenticator checks each handshake), so strangers can't register or listen."""
        if not self.curve_authorized_keys:
            raise ValueError("--curve-server-secret-key needs --curve-authorized-keys (a folder of worker public keys)")
        public, secret = zmq.auth.load_certificate(self.curve_secret_key)
        if secret is None:
            raise ValueError(f"{self.curve_secret_key} holds no secret key")
        self._authenticator = _Authenticator(self._context)
        self._authenticator.start()
        self._authenticator.configure_curve(domain="*", location=self.curve_authorized_keys)
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret
        log.info("CURVE on: workers must hold a key from %s", self.curve_authorized_keys)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.dispatch.stop("the gateway is shutting down")
        if self._socket is not None:
            asyncio.get_running_loop().remove_reader(self._socket.FD)
            self._socket.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    @property
    def learn_model(self) -> Callable[[ModelInfo], Awaitable[None]] | None:
        return self._learn_model

    @learn_model.setter
    def learn_model(self, learn: Callable[[ModelInfo], Awaitable[None]] | None) -> None:
        """Set once the model registry exists (it needs this client first)."""
        self._learn_model = learn
        self.dispatch.roster.learns = learn is not None

    # ---- what the HTTP side uses -------------------------------------------------------------

    @property
    def workers(self) -> dict[bytes, WorkerInfo]:
        return self.dispatch.roster.workers

    @property
    def models(self) -> dict[str, ModelPool]:
        return self.dispatch.roster.models

    def limits(self, model: str) -> tuple[int, int]:
        return self.dispatch.roster.limits(model)

    def available(self, model: str) -> list[WorkerInfo]:
        return self.dispatch.roster.available(model, self.dispatch.clock())

    def ready_workers(self) -> list[WorkerInfo]:
        return self.dispatch.ready_workers()

    def snapshot(self) -> dict:
        return {**self.dispatch.snapshot(), "dropped_frames": self.dropped_frames}

    def submit(
        self, request: NewRequest, model: str, trace: Trace = UNTRACED, delivered: list[int] | None = None
    ) -> RequestStream:
        """Send a request to a worker of ``model`` (at the end of this loop tick, with the others of
        the tick); its outputs arrive on the returned stream. ``delivered``: see ``Dispatcher.submit``."""
        stream = self.dispatch.submit(request, model, trace, delivered)
        self._busy.set()
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)
        return stream

    def send(self, identity: bytes, msg: protocol.Message) -> None:
        """Send one message to one worker now (a LoRA command)."""
        self._send(identity, protocol.encode(msg))

    def abort(self, request_id: str) -> None:
        """Forget a request and tell its worker to stop it (the client left, or a stop string hit)."""
        self.dispatch.abort(request_id)
        self._send_outbox()

    # ---- socket side -------------------------------------------------------------------------

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._send_outbox()

    def _send_outbox(self) -> None:
        """Send what dispatch decided (requests it assigned included), in order; start loading the
        tokenizers it asked for."""
        self.dispatch.flush()
        outbox = self.dispatch.outbox
        while outbox:
            identity, msg = outbox.popleft()
            self._send(identity, _HEARTBEAT if msg is GATEWAY_HEARTBEAT else protocol.encode(msg))
        if self.dispatch.to_learn:
            for identity, info in self.dispatch.to_learn:
                task = asyncio.get_running_loop().create_task(self._learn(identity, info))
                self._tasks.append(task)
                task.add_done_callback(self._tasks.remove)
            self.dispatch.to_learn.clear()

    def _send(self, identity: bytes, frames: list[bytes]) -> None:
        """Send without blocking; a send that fails (EHOSTUNREACH under ROUTER_MANDATORY, or EAGAIN
        when the peer's queue is full) purges a registered worker."""
        error = self._send_now([identity, *frames])
        if error is not None:
            self._failed(identity, error)

    def _send_now(self, frames: list[bytes]) -> zmq.ZMQError | None:
        """One non-blocking send, then the wake-up it may have taken: a send handles zmq's pending
        commands, the arrival of a message among them, which then no longer shows on the FD."""
        assert self._socket is not None
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            return exc
        finally:
            if self._socket.getsockopt(_EVENTS) & _POLLIN:
                self._readable.set()
        return None

    def _failed(self, identity: bytes, exc: BaseException) -> None:
        self.dispatch.unreachable(identity, exc.strerror if isinstance(exc, zmq.ZMQError) else str(exc))
        self._send_outbox()

    def _reachable(self, identity: bytes) -> bool:
        """Whether the ROUTER can still route to this peer: it takes a heartbeat."""
        return self._send_now([identity, *_HEARTBEAT]) is None

    async def _learn(self, identity: bytes, info: ModelInfo) -> None:
        error = None
        try:
            await self.learn_model(info)  # type: ignore[misc]
        except Exception as exc:
            error = exc
        self.dispatch.learned(identity, info, error)
        self._send_outbox()

    async def _receive_loop(self) -> None:
        """Wait for zmq's FD, then read the messages waiting (up to RECEIVE_BATCH) before letting
        other tasks run: a burst of heartbeats or step outputs costs one wake-up."""
        assert self._socket is not None
        sock, loop, fd = self._socket, asyncio.get_running_loop(), self._socket.FD
        reading = False  # the FD's reader is on: it is level-triggered, so off through the idle pause
        while True:
            if not sock.getsockopt(_EVENTS) & _POLLIN:  # this read also re-arms the FD
                if not reading:
                    loop.add_reader(fd, self._readable.set)
                    reading = True
                await self._readable.wait()
            self._readable.clear()
            for _ in range(self.RECEIVE_BATCH):
                if not sock.getsockopt(_EVENTS) & _POLLIN:
                    break
                self._handle(sock.recv_multipart(zmq.NOBLOCK, copy=False))
            self._send_outbox()
            await asyncio.sleep(0)  # more may wait: the other tasks run first
            if not self.dispatch.streams:
                if reading:
                    loop.remove_reader(fd)
                    reading = False
                # Idle: what arrives is heartbeats, judged over seconds. Let them gather for a few
                # ms instead of waking for each (1,024 workers: 1,024 wake-ups a second); a submit
                # ends the pause at once, so no request waits on it.
                self._busy.clear()
                try:
                    async with asyncio.timeout(self.IDLE_GATHER_S):
                        await self._busy.wait()
                except TimeoutError:
                    pass

    RECEIVE_BATCH = 256  # messages handled in a row before the loop lets other tasks run
    IDLE_GATHER_S = 0.02

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            msg = protocol.decode([f.buffer for f in frames[1:]])
        except protocol.VersionMismatch as exc:
            self._other_version(identity, exc)
            return
        except protocol.ProtocolError as exc:
            self.dropped_frames += 1
            log.warning("dropped a malformed message from %r: %s", identity[:64], exc)
            return
        if isinstance(msg, LoraResult):  # an answer to a load or unload of an adapter (gateway/fleet/lora.py)
            self.loras.answered(self.workers.get(identity), msg)
            return
        try:
            self.dispatch.on_message(identity, msg)
        except Exception:  # one bad message must not stop the receive loop
            log.exception("failed to handle %s", type(msg).__name__)

    def _other_version(self, identity: bytes, exc: protocol.VersionMismatch) -> None:
        """A worker of another protocol version: its Ready is refused, in its version's words when
        this side can write them; its other messages are dropped."""
        self.dropped_frames += 1
        if exc.msg_type != MsgType.READY:
            log.warning("dropped a message from %r: %s", identity[:64], exc)
            return
        why = f"it speaks protocol {exc.version}; this gateway speaks {protocol.PROTOCOL_VERSION} (run the same llmpool version on both)"
        frames = protocol.refusal(exc.version, self.dispatch.roster.refusal(identity, exc.sender_name(), why))
        if frames is not None:
            self._send(identity, frames)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.dispatch.tick()
            self._send_outbox()

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """With CURVE on, log every refused handshake (a worker without keys, or with a key not in
        the authorized folder); zmq would otherwise refuse them without a word."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event != protocol.HANDSHAKE_SUCCEEDED:
                    log.warning(
                        "a worker's handshake on %s %s",
                        self.bind_address,
                        protocol.HANDSHAKE_EVENTS.get(event, str(event)),
                    )
        finally:
            monitor.close(linger=0)


class _Authenticator(zmq.auth.asyncio.AsyncioAuthenticator):
    """ZAP for CURVE that names the keys it refuses (pyzmq logs refusals at debug level only)."""

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            log.warning(
                "refused a worker's CURVE key %s: %s", z85.encode(client_key).decode(), reason.decode(errors="replace")
            )
        return allowed, reason
