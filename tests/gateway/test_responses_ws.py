"""The Responses WebSocket's own life, in process (Litestar's test client, no model): it closes
cleanly when idle and at its age limit, after the limit's error event; bad events keep it open."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import pytest
from litestar import Litestar
from litestar.di import Provide
from litestar.exceptions import WebSocketDisconnect
from litestar.testing import TestClient

from gateway.generate.model_registry import ModelRegistry
from gateway.http.routes.responses_ws import SocketDrain, SocketLimits, responses_socket
from gateway.state.files import Files
from gateway.state.service import StateService


def _blank(kind: type) -> Callable[[], object]:
    """A service of that type, never called: no event these tests send starts a response."""
    return lambda: kind.__new__(kind)


def _app(limits: SocketLimits) -> Litestar:
    kinds = {"models": ModelRegistry, "stored": StateService, "files": Files}
    services = {name: Provide(_blank(kind), sync_to_thread=False) for name, kind in kinds.items()}
    app = Litestar(route_handlers=[responses_socket], dependencies=services)
    app.state.websocket_limits = limits
    app.state.websocket_drain = SocketDrain()
    return app


def _client(idle: float, max_age: float) -> TestClient:
    return TestClient(_app(SocketLimits(idle_timeout=idle, max_age=max_age)))


def test_an_idle_socket_is_closed():
    with _client(0.3, 60) as client, client.websocket_connect("/v1/responses") as ws:
        started = time.monotonic()
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1000 and 0.25 < time.monotonic() - started < 5


def test_a_busy_socket_gets_the_limit_error_event_at_its_age_limit_then_a_close():
    with _client(0.5, 1.5) as client, client.websocket_connect("/v1/responses") as ws:
        started, codes = time.monotonic(), []
        while not codes or codes[-1] != "websocket_connection_limit_reached":
            ws.send_text('{"type": "response.cancel"}')  # a bad event: an error event, and activity
            event = json.loads(ws.receive_text())
            assert event["type"] == "error" and event["status"] == 400
            codes.append(event["error"]["code"])
            time.sleep(0.2)
        assert set(codes[:-1]) == {"unknown_event"} and time.monotonic() - started > 1.4, codes
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_text()
        assert closed.value.code == 1000


def test_a_draining_gateway_closes_its_sockets_with_service_restart():
    """Through the gateway's own HTTP server (its httptools protocol hands the upgrade to uvicorn's
    WebSocket side): the server's shutdown closes an idle socket with 1012, cleanly, by the socket's own
    handler (the drain; test_processes checks that a response in flight ends first)."""
    import asyncio
    import threading

    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from gateway.http.server import GatewayServer, HttpLimits, uvicorn_config
    from tests.conftest import free_port

    app = _app(SocketLimits())
    port = free_port()
    server = GatewayServer(uvicorn_config(app, "127.0.0.1", port, HttpLimits(), 5.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    async def session() -> int:
        for _ in range(100):
            if server.started:
                break
            await asyncio.sleep(0.05)
        async with connect(f"ws://127.0.0.1:{port}/v1/responses") as ws:
            await ws.send("not json")
            assert json.loads(await ws.recv())["error"]["code"] == "invalid_json"
            server.should_exit = True  # what SIGTERM does
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
            return closed.value.rcvd.code

    assert asyncio.run(session()) == 1012
    thread.join(10)
