"""Every gateway a worker serves: found by name (again and again, in the background), connected with
backoff, judged silent, and told the worker's load when its heartbeat is due.

A gateway silent for ``liveness`` intervals has moved this worker's requests already: the worker
drops them (worker/proc.py) and connects again after 1 s, doubling to 32 s while it stays away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import zmq

from common.protocol import Goodbye, Heartbeat, Ready
from worker.handshake import GatewayLink, named, resolve_gateways

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 32.0


class Gateways:
    def __init__(
        self,
        addresses: str,
        name: str,
        ready: Ready,
        curve_keys: tuple[str, str] | None,
        interval: float,
        liveness: int,
    ) -> None:
        self.addresses = addresses
        self.name = name
        self.ready = ready
        self.curve_keys = curve_keys  # (own secret key file, gateway public key file)
        self.interval = interval
        self.liveness = liveness
        self.context = zmq.Context.instance()
        self.links: dict[str, GatewayLink] = {}
        self._resolved = resolve_gateways(addresses)

    def connected(self) -> Iterator[GatewayLink]:
        return (link for link in list(self.links.values()) if link.sock is not None)

    def resolve_in_background(self, stopped: Callable[[], bool]) -> None:
        """Resolve the names again every liveness period (DNS can take seconds: not in the step
        loop); ``update`` picks the new list up. Addresses that name no host need no thread."""
        if not named(self.addresses):
            return

        def loop() -> None:
            while not stopped():
                time.sleep(max(1.0, self.interval * self.liveness))
                self._resolved = resolve_gateways(self.addresses)

        threading.Thread(target=loop, name="resolve-gateways", daemon=True).start()

    def update(self, now: float, accepting: bool) -> None:
        """Add the gateways found, forget those gone and unconnected, connect those due (not while
        draining: ``accepting`` False)."""
        resolved = set(self._resolved)
        for address in resolved - self.links.keys():
            if accepting:
                self.links[address] = GatewayLink(address)
                if len(self.links) > 1:
                    log.info("gateway %s found; serving %d gateways", address, len(self.links))
        for address, link in list(self.links.items()):
            link.resolved = address in resolved
            if link.sock is None and not link.resolved:
                del self.links[address]  # gone from the name and not connected: forget it
            elif link.sock is None and now >= link.retry_at and accepting:
                link.connect(self.context, self.name, self.ready, self.curve_keys)

    def heartbeat_due(self, now: float) -> bool:
        return any(now >= link.next_heartbeat for link in self.connected())

    def due_or_silent(self, now: float) -> bool:
        """A heartbeat is due, or a gateway has gone silent: the socket loop needs the engine."""
        return self.heartbeat_due(now) or self.silent(now)

    def silent(self, now: float, link: GatewayLink | None = None) -> bool:
        """Whether a connected gateway (``link``, or any) has been silent past its liveness."""
        links = self.connected() if link is None else [link]
        return any(one.sock is not None and now - one.last_heard > self.interval * self.liveness for one in links)

    def send_heartbeats(self, now: float, load: Heartbeat) -> None:
        """``load`` to every gateway whose heartbeat is due; a drain is announced at once. The
        outputs of the steps that ended must have gone first (a gateway that saw a heartbeat before
        them would take a finished request for a lost one)."""
        for link in self.connected():
            if load.draining and not link.announced_drain:
                link.announced_drain, link.next_heartbeat = True, now  # tell the gateway right away
            if now >= link.next_heartbeat:
                link.send(load)
                link.next_heartbeat = now + self.interval

    def close(self, link: GatewayLink, now: float) -> None:
        """Close a silent gateway's link: connect again after a backoff, or forget it if its address
        no longer resolves."""
        link.close(linger=0)
        link.backoff = 1.0 if link.heard else min(link.backoff * 2, MAX_BACKOFF_S)
        link.retry_at = now + link.backoff
        if not link.resolved:
            del self.links[link.address]
        else:
            log.info("reconnecting to %s in %.0f s", link.address, link.backoff)

    def goodbye(self) -> None:
        for link in self.connected():
            link.send(Goodbye("shutting down"))
            link.close(linger=500)
