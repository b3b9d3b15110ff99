"""The HTTP server: uvicorn with httptools (llhttp, the fastest parser uvicorn has), plus the limits
uvicorn lacks, enforced where the bytes arrive, before the application sees a request.

uvicorn with httptools has no limit on a request head: httptools joins a header's pieces in Python,
so one 256 MiB header stalled the event loop for 12-26 s; it has no timeout for a request's head or
body, so a client sending 1 byte/s, or nothing, or less body than its Content-Length held its
connection (and its body buffer) forever. h11 has a head-size limit but no timeouts either, and it
parses and frames every streamed chunk in Python. Here each connection gets:

- a head (request line + headers) of at most ``max_header_bytes`` and ``max_headers`` headers: 431;
- ``header_timeout`` seconds from its first byte (or from the connection's start) to the end of the
  head: 408, or a silent close if it never sent a byte;
- ``body_timeout`` seconds from the end of the head to the end of the body: 408;
- ``keep_alive_timeout`` seconds of idleness between requests (uvicorn's own keep-alive timer);
- at most ``max_connections`` open at once: the next ones get a 503 and are closed unread.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

_HEAD_END = b"\r\n\r\n"
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What one connection may do; see the module docstring (the flags' defaults live in gateway/config.py)."""

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 30.0
    max_connections: int = 2048


class _Refusals:
    """Counts refused connections and logs them at most once every 10 s, so that an attack of
    thousands of connections is one line, not thousands."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.logged_at = 0.0

    def add(self, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = time.monotonic()
        if now - self.logged_at >= 10.0:
            self.logged_at = now
            log.warning(
                "HTTP connections refused so far: %s", ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
            )


REFUSALS = _Refusals()


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request that broke a limit."""


def _response(status: int, message: str, extra: bytes = b"") -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}})
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n" % (
        status,
        _REASONS[status],
        len(body),
    )
    return head + extra + b"\r\n" + body


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of ``LIMITS`` (set by ``protocol_class``)."""

    LIMITS = HttpLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._in_head = True  # between requests, or reading a request's head
        self._head_bytes = 0
        self._head_tail = b""  # the last 3 bytes of the head so far: its end may straddle two reads
        self._header_count = 0
        self._refusal: tuple[int, str] | None = None

    # Connection life

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.LIMITS.max_connections:
            self.connections.discard(self)
            self._close_with(
                503,
                f"the gateway holds its limit of {self.LIMITS.max_connections} connections; retry",
                b"retry-after: 1\r\n",
            )
            REFUSALS.add("connections over the limit")
            return
        self._arm(self.LIMITS.header_timeout, "header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._unset_keepalive_if_required()
        if self._in_head:
            if self._timer is None:  # the first byte of a request on a kept-alive connection
                self._arm(self.LIMITS.header_timeout, "header")
            if self._count_head(data) > self.LIMITS.max_header_bytes:
                self._refuse(431, f"the request line and headers are over {self.LIMITS.max_header_bytes} bytes")
                return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
                return
            self.logger.warning("Invalid HTTP request received.")
            self.send_400_response("Invalid HTTP request received.")

    # Parser callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.LIMITS.max_headers:
            self._refusal = (431, f"more than {self.LIMITS.max_headers} headers")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._arm(self.LIMITS.body_timeout, "body")  # on_message_complete follows at once when there is no body
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes, self._head_tail, self._header_count = True, 0, b"", 0
        super().on_message_complete()

    # Limits

    def _count_head(self, data: bytes) -> int:
        """The head's size so far, counting only the bytes of ``data`` up to the head's end."""
        tail = self._head_tail
        end = (tail + data[:3]).find(_HEAD_END) if tail else -1
        if end >= 0:
            counted = end + 4 - len(tail)
        else:
            end = data.find(_HEAD_END)
            counted = len(data) if end < 0 else end + 4
            self._head_tail = data[-3:] if end < 0 else b""
        self._head_bytes += counted
        return self._head_bytes

    def _arm(self, seconds: float, phase: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if (
            phase == "body" and self.flow.read_paused
        ):  # we stopped reading (a pipelined request waits): not the client's delay
            self._arm(self.LIMITS.body_timeout, phase)
            return
        if phase == "header" and self._head_bytes == 0:
            REFUSALS.add("idle connections closed")
            self.transport.close()  # a connection that never sent a request: nothing to answer
            return
        seconds = self.LIMITS.header_timeout if phase == "header" else self.LIMITS.body_timeout
        self._refuse(
            408, f"the request's {'headers' if phase == 'header' else 'body'} did not arrive within {seconds:g} s"
        )

    def _refuse(self, status: int, message: str) -> None:
        REFUSALS.add(f"{status}")
        cycle = self.cycle  # this request's once its head is read; before that the previous one's
        if cycle is not None and cycle.response_started and (not self._in_head or not cycle.response_complete):
            self.transport.close()  # a response is on the wire (a 413 before the body ended, a pipelined answer): just cut
        else:
            self._close_with(status, message)

    def _close_with(self, status: int, message: str, extra: bytes = b"") -> None:
        self._disarm()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # whatever the application still sends goes nowhere
            self.cycle.message_event.set()
        self.transport.write(_response(status, message, extra))
        self.transport.close()


def protocol_class(limits: HttpLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class bound to ``limits`` (uvicorn builds one instance per connection from the class)."""
    return type("LimitedHttpProtocol", (LimitedHttpToolsProtocol,), {"LIMITS": limits})


def raise_fd_limit(max_connections: int) -> None:
    """Let the process hold ``max_connections`` sockets plus its own files: many systems start
    processes with a soft limit of 1,024 descriptors, and accept() failing with EMFILE would turn
    away connections below the cap without an answer."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + 512
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning("--max-connections %d: this process may open only %d files (ulimit -Hn)", max_connections, new)


class GatewayServer(uvicorn.Server):
    """uvicorn's server, whose shutdown first lets the open WebSockets end their responses in flight
    and close themselves (the app's ``state.websocket_drain``): uvicorn's own shutdown would close
    them at once with 1012, cutting a response mid-stream, while it lets HTTP responses finish."""

    async def shutdown(self, sockets: list | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the sockets drain (uvicorn closes them again: harmless)
        drain = getattr(getattr(self.config.app, "state", None), "websocket_drain", None)
        if drain is not None and not self.force_exit:
            await drain.drain(self.config.timeout_graceful_shutdown or 0.0)
        await super().shutdown(sockets)


def uvicorn_config(app: Any, host: str, port: int, limits: HttpLimits, graceful_shutdown: float) -> uvicorn.Config:
    """The gateway's uvicorn settings: httptools with ``limits``, uvloop when installed, no access log."""
    raise_fd_limit(limits.max_connections)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_class(limits),
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type] - call_later takes a float
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=graceful_shutdown,
    )
