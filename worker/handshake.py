"""The worker's links to its gateways: finding them, connecting (the ``Ready`` handshake, CURVE),
reading how the handshake went, and sending without ever blocking the step loop.

A worker serves every gateway in ``--gateway-address`` (comma-separated). A name that resolves to
several addresses (a Kubernetes headless Service of gateways) means several gateways; names are
resolved again in the background, so gateways that come and go are found and dropped.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import time
import uuid
from collections import deque

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from common import protocol
from common.protocol import Ready

log = logging.getLogger(__name__)

_TCP_ADDRESS = re.compile(r"^tcp://(?P<host>[^:/\[\]]+):(?P<port>\d+)$")


def resolve_gateways(addresses: str) -> list[str]:
    """Every gateway address in a comma-separated list: a host name that resolves to several IPv4
    addresses stands for several gateways (one name for a set of replicas). IP addresses, ipc://
    and names that don't resolve (zmq retries them itself) are kept as given."""
    found: list[str] = []
    for address in (a.strip() for a in addresses.split(",")):
        match = _TCP_ADDRESS.match(address)
        if not match or match["host"] == "*" or _is_ip(match["host"]):
            found.append(address)
            continue
        try:
            infos = socket.getaddrinfo(match["host"], int(match["port"]), socket.AF_INET, socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("could not resolve %s (%s); trying it as given", address, exc)
            found.append(address)
            continue
        found.extend(f"tcp://{ip}:{match['port']}" for ip in sorted({info[4][0] for info in infos}))
    return list(dict.fromkeys(a for a in found if a))


def named(addresses: str) -> bool:
    """Whether any address names its host (and so may resolve differently later)."""
    matches = (_TCP_ADDRESS.match(a.strip()) for a in addresses.split(","))
    return any(m is not None and m["host"] != "*" and not _is_ip(m["host"]) for m in matches)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class GatewayLink:
    """One gateway: its socket, when it was last heard from, and the requests it sent."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.handshakes_seen: set[int] = set()
        self.heard = False  # answered since this connection began
        self.last_heard = 0.0
        self.next_heartbeat = 0.0
        self.announced_drain = False
        self.unsent: deque[list[bytes]] = deque()  # messages the socket could not take yet, in order
        self.requests: set[str] = set()
        self.backoff = 1.0
        self.retry_at = 0.0  # when a closed link connects again
        self.resolved = True  # False once its address no longer resolves: dropped when it goes silent

    def connect(self, context: zmq.Context, name: str, ready: Ready, curve_keys: tuple[str, str] | None) -> None:
        """A new connection under a fresh identity (the gateway may still hold the old one until it
        expires), starting with ``ready``."""
        sock = new_dealer(context, name, curve_keys)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        self.monitor = sock.get_monitor_socket(protocol.HANDSHAKE_EVENT_MASK)
        self.handshakes_seen = set()
        sock.connect(self.address)
        self.sock = sock
        self.unsent.clear()  # meant for the old connection; the gateway resumes those requests itself
        self.heard, self.last_heard, self.next_heartbeat, self.announced_drain = False, time.monotonic(), 0.0, False
        self.send(ready)
        log.info("connecting to the gateway at %s as %s", self.address, name)

    def close(self, linger: int) -> None:
        if self.sock is None:
            return
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger)
        self.sock = self.monitor = None

    def read_monitor(self) -> None:
        """Say how the handshake went, once per outcome and connection (zmq retries every 100 ms)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event in self.handshakes_seen:
                continue
            self.handshakes_seen.add(event)
            outcome = protocol.HANDSHAKE_EVENTS.get(event, str(event))
            if event == protocol.HANDSHAKE_SUCCEEDED:
                log.debug("handshake with the gateway at %s %s", self.address, outcome)
            else:
                log.error("handshake with the gateway at %s %s", self.address, outcome)

    def receive(self) -> list[bytes] | None:
        """The next waiting message's frames, or None."""
        try:
            return self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None

    def send(self, msg: protocol.Message) -> None:
        """Never block the step loop on a slow gateway, and never lose a message either (a lost
        output is a gap in a stream): what the socket can't take now waits for the next try."""
        if not self.unsent:
            try:
                self.sock.send_multipart(protocol.encode(msg), zmq.NOBLOCK)
                return
            except zmq.Again:
                log.warning("gateway %s not accepting messages; holding them until it does", self.address)
        self.unsent.append(protocol.encode(msg))

    def flush(self) -> None:
        """Send what was held back, oldest first, as far as the socket takes it."""
        while self.unsent:
            try:
                self.sock.send_multipart(self.unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            self.unsent.popleft()

    def stirred(self, events: dict) -> bool:
        """Whether the poll saw a message or a handshake event on this link."""
        return self.sock is not None and (self.sock in events or self.monitor in events)


def new_dealer(context: zmq.Context, name: str, curve_keys: tuple[str, str] | None) -> zmq.Socket:
    """A DEALER socket under a fresh identity ``name/nonce`` (the gateway may still hold an old
    one), with CURVE keys when given: (own secret key file, gateway public key file)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{name}/{uuid.uuid4().hex[:8]}".encode())
    if curve_keys:
        own_public, own_secret = zmq.auth.load_certificate(curve_keys[0])
        server_public, _ = zmq.auth.load_certificate(curve_keys[1])
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = own_public, own_secret, server_public
    return sock


def report_start_failure(
    addresses: str, name: str, message: str, curve_keys: tuple[str, str] | None, wait_s: float = 2.0
) -> None:
    """Tell every gateway why this worker cannot start (before it exits), so that its ``/health``
    says what is failing: a ``WorkerError`` from a peer that never registered. Best effort, at most
    ``wait_s`` per gateway: an unreachable gateway must not hold the exit up."""
    context = zmq.Context.instance()
    for address in resolve_gateways(addresses):
        sock = new_dealer(context, name, curve_keys)
        sock.connect(address)
        try:
            sock.send_multipart(protocol.encode(protocol.WorkerError(message)), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("could not tell the gateway at %s why this worker stops", address)
        sock.close(linger=int(wait_s * 1000))
