"""The Responses WebSocket's own life, in process (Litestar's test client, no model): it closes
cleanly when idle and at its age limit, after the limit's error event; bad events keep it open."""

from __future__ import annotations

import json
import time

import pytest
from litestar import Litestar
from litestar.exceptions import WebSocketDisconnect
from litestar.testing import TestClient

from gateway.http.routes.responses_ws import SocketLimits, responses_socket


def _client(idle: float, max_age: float) -> TestClient:
    app = Litestar(route_handlers=[responses_socket])
    app.state.websocket_limits = SocketLimits(idle_timeout=idle, max_age=max_age)
    return TestClient(app)


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
