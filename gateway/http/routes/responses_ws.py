"""WebSocket /v1/responses: OpenAI's WebSocket mode of the Responses API, on the same core as POST.

The client sends ``{"type": "response.create", ...}`` events whose other fields are a Responses
body (``stream`` is implied; ``background`` is refused); each response's events come back as JSON
text frames, exactly the SSE stream's events (names, order, payloads). One response is in flight per
socket: a ``response.create`` sent while one runs gets an error event and changes nothing. A
follow-up sends ``previous_response_id`` and only its new input; the socket keeps its last
response's conversation in memory, so this works with ``store: false`` too.

A bad event gets OpenAI's WebSocket error event, ``{"type": "error", "status": 400, "error": {...}}``,
and the socket stays open. The socket's turns go to one worker while it lives (its KV stays warm;
``gateway.fleet.dispatch.PINNED``). It is closed (code 1000) after ``--websocket-idle-timeout``
seconds without a response in flight or an event from the client, and at ``--websocket-max-age``
(60 minutes, as OpenAI's) after an error event with code ``websocket_connection_limit_reached``. A
gateway that drains (SIGTERM) lets each socket's response in flight end, then closes the socket with
code 1012 ("service restart": reconnect elsewhere), within ``--shutdown-grace`` (``SocketDrain``,
which gateway/http/server.py runs before uvicorn's own shutdown, which would cut them at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar import WebSocket, websocket
from litestar.di import NamedDependency
from litestar.exceptions import WebSocketDisconnect

from gateway.errors import GatewayError, InvalidRequest, NoWorkerAvailable
from gateway.fleet.dispatch import PINNED, Pin
from gateway.generate.model_registry import ModelRegistry
from gateway.http.auth import caller_key, caller_owner
from gateway.http.routes.responses import start_response
from gateway.policy.caller import Caller
from gateway.schemas.responses import ResponsesRequest
from gateway.state.files import Files
from gateway.state.service import StateService

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


def error_event(exc: GatewayError) -> bytes:
    """OpenAI's WebSocket error event (the HTTP status it would have had, and its usual error body)."""
    return _encoder.encode({"type": "error", "status": exc.status_code, **exc.body()})


def create_request(text: str) -> ResponsesRequest:
    """A ``response.create`` event's body, checked as POST /v1/responses checks its body."""
    try:
        event = _decoder.decode(text)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the event is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(event, dict) or event.get("type") != "response.create":
        kind = event.get("type") if isinstance(event, dict) else None
        raise InvalidRequest(
            f"unknown event type {kind!r}: this socket takes `response.create` events",
            param="type",
            code="unknown_event",
        )
    body = {k: v for k, v in event.items() if k not in ("type", "event_id")}
    if body.pop("background", None):
        raise InvalidRequest("`background` is not supported over WebSocket", param="background")
    body.pop("stream", None)
    try:
        req = msgspec.convert(body, ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid `response.create`: {exc}") from None
    req.stream = True
    return req


class SocketDrain:
    """The gateway's open sockets, told when it drains: each ends its response in flight, then closes
    with 1012 (``app.state.websocket_drain``)."""

    def __init__(self) -> None:
        self.draining = asyncio.Event()
        self.open = 0
        self._closed = asyncio.Event()

    async def drain(self, timeout: float) -> None:
        """Tell every socket, then wait for them all to close, at most ``timeout`` seconds."""
        self.draining.set()
        if self.open:
            log.info("draining %d WebSocket(s): their responses in flight end first", self.open)
            self._closed.clear()
            try:
                await asyncio.wait_for(self._closed.wait(), timeout)
            except TimeoutError:
                log.warning("%d WebSocket(s) still open after %g s: closing them", self.open, timeout)

    def closed(self) -> None:
        self.open -= 1
        if not self.open:
            self._closed.set()


@dataclass(frozen=True, slots=True)
class SocketLimits:
    """``--websocket-idle-timeout`` and ``--websocket-max-age`` (seconds)."""

    idle_timeout: float = 600.0
    max_age: float = 3600.0


class Session:
    """One socket: its sends (one at a time), its response in flight, the last conversation, its pin;
    the services its responses use (the handler's dependencies)."""

    def __init__(self, socket: WebSocket, models: ModelRegistry, state: StateService, files: Files | None) -> None:
        self.socket = socket
        self.models, self.state, self.files = models, state, files
        self.lock = asyncio.Lock()
        self.turn: asyncio.Task | None = None
        self.local: dict[str, list[dict[str, Any]]] = {}  # the last response's conversation, by its id
        self.pin = Pin()
        self.last_active = time.monotonic()

    async def send(self, data: bytes) -> None:
        async with self.lock:
            await self.socket.send_data(data.decode(), mode="text")

    @property
    def busy(self) -> bool:
        return self.turn is not None and not self.turn.done()

    async def respond(self, req: ResponsesRequest) -> None:
        """One response: its events as frames; a refused request is an error event."""
        socket = self.socket
        caller = Caller(owner=caller_owner(socket), key=caller_key(socket), address=(socket.client or (None,))[0])
        try:
            served = self.models.get(req.model)
            started = await start_response(req, served, caller, self.state, self.files, self.local)
            async for event in started.events():
                await self.send(event.data)
        except GatewayError as exc:
            await self.send(error_event(exc))
            return
        finally:
            self.last_active = time.monotonic()
        if started.response.status in ("completed", "incomplete"):
            self.local = {started.response.id: started.conversation()}


@websocket(["/v1/responses", "/responses"])
async def responses_socket(
    socket: WebSocket,
    models: NamedDependency[ModelRegistry],
    stored: NamedDependency[StateService],
    files: NamedDependency[Files | None],
) -> None:
    config, drain = socket.app.state.websocket_limits, socket.app.state.websocket_drain
    await socket.accept()
    session = Session(socket, models, stored, files)
    PINNED.set(session.pin)  # this handler's task (and the runs it starts) prefer the socket's worker
    drain.open += 1
    code = None
    try:
        code = await _serve(session, config, drain.draining)
    except WebSocketDisconnect:
        pass
    finally:
        await _end_turn(session)
        session.pin.open = False  # no longer counted in /workers
        try:
            if code is not None and socket.connection_state != "disconnect":
                await socket.close(code=code)  # before the drain counts it closed: uvicorn's shutdown follows
        finally:
            drain.closed()


async def _serve(session: Session, config: SocketLimits, draining: asyncio.Event) -> int:
    """The socket's events until it should close (idle, too old, or its gateway draining): the close code."""
    closes_at = time.monotonic() + config.max_age
    while True:
        now = time.monotonic()
        if draining.is_set() and not session.busy:
            return 1012  # the response in flight, if any, has ended
        if now >= closes_at:
            limit = InvalidRequest(
                f"this WebSocket reached its {config.max_age:g}-second limit; open a new one",
                code="websocket_connection_limit_reached",
            )
            await session.send(error_event(limit))
            return 1000
        idle_at = session.last_active + config.idle_timeout
        if not session.busy and now >= idle_at:
            return 1000
        wait = closes_at - now if session.busy else min(closes_at, idle_at) - now
        if draining.is_set():
            wait = min(wait, 0.1)  # watch the response in flight end
        text = await _next_text(session.socket, wait, draining)
        if text is not None and draining.is_set():  # a draining socket starts nothing new
            await session.send(
                error_event(NoWorkerAvailable("the gateway is shutting down: reconnect", code="server_shutting_down"))
            )
        elif text is not None:
            session.last_active = time.monotonic()
            await _on_event(session, text)


async def _next_text(socket: WebSocket, wait: float, draining: asyncio.Event) -> str | None:
    """The client's next text frame, or None after ``wait`` seconds or when the gateway starts draining
    (once it has, only the timer wakes: the caller polls its turn's end)."""
    receive = asyncio.ensure_future(socket.receive_text())
    waiters = {receive} if draining.is_set() else {receive, asyncio.ensure_future(draining.wait())}
    try:
        done, _ = await asyncio.wait(waiters, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters - {receive}:
            waiter.cancel()
    if receive in done:
        return receive.result()
    receive.cancel()
    await asyncio.gather(receive, return_exceptions=True)
    return None


async def _on_event(session: Session, text: str) -> None:
    try:
        req = create_request(text)
        if session.busy:
            raise InvalidRequest(
                "a response is already in progress on this socket: send the next `response.create` after it ends",
                code="response_already_in_progress",
            )
    except GatewayError as exc:
        await session.send(error_event(exc))
        return
    session.turn = asyncio.create_task(session.respond(req), name="responses-websocket-turn")


async def _end_turn(session: Session) -> None:
    """The client left (or the socket closes): its response in flight stops, its KV blocks freed."""
    if session.turn is not None and not session.turn.done():
        session.turn.cancel()
        await asyncio.gather(session.turn, return_exceptions=True)
