"""The HTTP layer's limits (gateway/http/server.py) against a real gateway process, with raw sockets:
oversized and overlong heads are 431s, slow and silent clients are closed on time, a body shorter
than its Content-Length ends in a 408, connections over the cap get a 503, and none of it stalls a
stream in flight. Also HEAD wherever GET, and /static's malformed paths as 404s.

One gateway with short timeouts (1-1.5 s) and a model-less worker (bench/fake_worker.py) serve the
module; the defaults are the same code with longer numbers."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import MODEL, Server, free_port, spawn, wait_until, worker_argv

HEADER_TIMEOUT, BODY_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS = 1.0, 1.5, 1.0, 64
LIMITS = [
    "--header-timeout",
    "1",
    "--body-timeout",
    "1.5",
    "--keep-alive-timeout",
    "1",
    "--max-connections",
    str(MAX_CONNECTIONS),
]
LIMITS += ["--max-header-size", "16KiB", "--max-headers", "50"]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(free_port(), free_port())
    server.processes.append(
        spawn(["gateway", "--port", str(server.port), "--zmq-bind", server.zmq_address, *LIMITS], "http-limits-gateway")
    )
    info = str(tmp_path_factory.mktemp("model-info") / "model-info.msgpack")
    worker = worker_argv(server.zmq_address, None, "--step-ms", "20", fake_info=info)
    server.processes.append(spawn(worker, "http-limits-worker"))
    try:
        server.wait_for_workers(1, timeout=120)
        yield server
    finally:
        server.stop()


def connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def read_until_closed(sock: socket.socket, limit: float = 10) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, data = time.monotonic(), b""
    sock.settimeout(limit)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def test_a_head_over_the_size_limit_is_a_431(gateway):
    sock = connect(gateway)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
    response, _ = read_until_closed(sock)
    assert status(response) == 431 and b"over 16384 bytes" in response, response[:200]
    sock = connect(gateway)
    sock.sendall(b"GET /health?" + b"q" * 20_000 + b" HTTP/1.1\r\n\r\n")  # the request line counts too
    assert status(read_until_closed(sock)[0]) == 431


def test_too_many_headers_is_a_431(gateway):
    for count, problem in (
        (51, b"more than 50 headers"),
        (100_000, b"over 16384 bytes"),
    ):  # 100,000 small ones hit the size first
        sock = connect(gateway)
        try:
            sock.sendall(
                b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(count)) + b"\r\n"
            )
        except ConnectionResetError:
            pass
        response, _ = read_until_closed(sock)
        assert status(response) == 431 and problem in response, response[:200]
    sock = connect(gateway)
    sock.sendall(b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(49)) + b"\r\n")
    assert status(sock.recv(65536)) == 200  # at the limit is fine


def test_a_huge_header_does_not_stall_a_stream_in_flight(gateway):
    """Issue 25: a 224-256 MiB header stalled the event loop for 12-26 s, and streams in flight
    broke. Now the sender is cut after the limit, and a stream's chunks keep coming meanwhile."""
    gaps: list[float] = []

    def stream() -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 100,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", gateway.base_url + "/v1/chat/completions", json=body, timeout=30) as response:
            last = time.monotonic()
            for _ in response.iter_lines():
                now = time.monotonic()
                gaps.append(now - last)
                last = now

    streamer = threading.Thread(target=stream)
    streamer.start()
    sock = connect(gateway)
    sent, chunk = 0, b"a" * 2**20
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nX-Big: ")
        while sent < 256 * 2**20:
            sock.sendall(chunk)
            sent += len(chunk)
    except (ConnectionResetError, BrokenPipeError):
        pass
    streamer.join(60)
    assert sent < 16 * 2**20, f"the gateway read {sent >> 20} MiB of one header"
    # Stalled, the stream stopped for 12-26 s; its gaps are tens of ms (3 s: room for a busy machine).
    assert len(gaps) > 100 and max(gaps) < 3.0, f"{len(gaps)} lines, longest gap {max(gaps):.2f} s"


def test_slow_and_silent_clients_are_closed_after_the_header_timeout(gateway):
    """Issue 25: 0 of 300 senders at 1 byte/s and 0 of 500 silent connections were ever closed."""
    silent = [connect(gateway) for _ in range(20)]
    slow = [connect(gateway) for _ in range(20)]
    done: list[tuple[bytes, float]] = []

    def dribble(sock: socket.socket) -> None:
        start = time.monotonic()
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":  # 4 bytes/s until the gateway answers or closes
            if select.select([sock], [], [], 0.25)[0]:
                break
            try:
                sock.send(bytes([byte]))
            except OSError:
                break
        data, _ = read_until_closed(sock)
        done.append((data, time.monotonic() - start))

    threads = [threading.Thread(target=dribble, args=(sock,)) for sock in slow]
    for thread in threads:
        thread.start()
    closed = [read_until_closed(sock) for sock in silent]
    for thread in threads:
        thread.join(20)
    assert all(data == b"" and elapsed < HEADER_TIMEOUT + 2 for data, elapsed in closed), closed
    assert len(done) == 20 and all(status(data) == 408 and elapsed < HEADER_TIMEOUT + 2 for data, elapsed in done), done


def test_a_body_shorter_than_its_content_length_is_a_408(gateway):
    """Issue 25: 200 such connections held 580 MiB, forever."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 3000000\r\n\r\n"
    socks = [connect(gateway) for _ in range(20)]
    for sock in socks:
        sock.sendall(head + b"{" + b" " * 2_000_000)
    results = [read_until_closed(sock) for sock in socks]
    assert all(status(data) == 408 and b"body" in data for data, _ in results), results[0][0][:200]
    assert max(elapsed for _, elapsed in results) < BODY_TIMEOUT + 3


def test_an_idle_kept_alive_connection_is_closed(gateway):
    sock = connect(gateway)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    data, elapsed = read_until_closed(sock)
    assert status(data) == 200 and KEEP_ALIVE - 0.2 < elapsed < KEEP_ALIVE + 2, (data[:100], elapsed)


def test_connections_over_the_cap_get_a_503_and_the_gateway_recovers(gateway):
    held = [connect(gateway) for _ in range(MAX_CONNECTIONS)]
    try:
        extra = connect(gateway)
        data, _ = read_until_closed(extra)
        assert status(data) == 503 and b"retry-after: 1" in data.lower(), data[:200]
    finally:
        for sock in held:
            sock.close()
    wait_until(
        lambda: gateway.get("/health").status_code == 200, 30, "a free connection again", interval=0.05
    )  # as it reads the closes


@pytest.mark.parametrize(
    "path", ["/health", "/ready", "/workers", "/metrics", "/v1/models", f"/v1/models/{MODEL}", "/", "/static/app.js"]
)
def test_head_is_answered_wherever_get_is(gateway, path):
    get, head = httpx.get(gateway.base_url + path), httpx.head(gateway.base_url + path)
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


@pytest.mark.parametrize(
    "path", ["/static/app.js%00.png", "/static/index.html/x", "/static/..%2fgateway%2fapp.py", "/static/nothing.js"]
)
def test_malformed_static_paths_are_404s(gateway, path):
    sock = connect(gateway)
    sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status(read_until_closed(sock)[0]) == 404
