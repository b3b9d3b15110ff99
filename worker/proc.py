"""The worker process's socket side: one DEALER per gateway, wrapped around the engine.

A worker serves every gateway in ``--gateway-address`` (comma-separated). A name that resolves to
several addresses (a Kubernetes headless Service of gateways) means several gateways; names are
resolved again in the background, so gateways that come and go are found and dropped. Each gateway
gets the worker's whole load in its heartbeats, and each request's outputs go back to the gateway
that sent it.

The worker schedules its own steps (no round trip to a gateway per token), and its steps overlap
the socket work (async scheduling, vLLM's engine-core split): the engine thread steps whenever the
engine has work, without waiting for anyone, and posts each step's outputs; the socket loop sends
them while the next step runs, and reads what arrives. To hand the engine new requests and aborts,
read its load for a heartbeat, or drop a silent gateway's requests, the socket loop takes the engine
between two steps, without waiting for the running one to end (``StepThread.want``). A step may
run for longer than the gateways' liveness (a long prefill chunk on a CPU, a first-use import):
heartbeats go on meanwhile, with the load read at the last hand-over, so a busy worker is never
taken for a dead one (a step that never ends is the gateway's hung-worker check to catch).

Any message from a gateway counts as its heartbeat; when one has been silent for ``liveness``
intervals the worker aborts that gateway's requests (it has moved them already) and reconnects to
it with backoff from 1 s to 32 s, while it goes on serving the others. So workers survive gateway
restarts, and a dead gateway costs only its own requests.

SIGTERM (or SIGINT) drains: the worker tells every gateway at once (``draining`` in its heartbeat),
finishes what it holds, then says Goodbye and exits. A second signal, or ``drain_timeout``, ends the
drain early; the gateways then move the requests that were left to other workers.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import math
import os
import queue
import re
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple, TypeVar

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from common import protocol
from common.model_source import TokenizerBundle
from common.protocol import Abort, AddRequests, DescribeModel, Goodbye, Heartbeat, ModelInfo, Ready, RequestOutput, StepOutputs, WorkerError
from worker.engine import Engine

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_BACKOFF_S = 32.0
CAPACITY_WINDOW_S = 5.0  # seconds of busy step time the capacity figure averages over
CAPACITY_STALE_S = 10.0  # a figure older than this (the worker idle) is withdrawn
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


class Refused(NamedTuple):
    """Requests of an AddRequests that did not decode, to be answered with these errors."""

    request_ids_and_reasons: list[tuple[str, str]]


Inbox = list[tuple[GatewayLink, AddRequests | Abort | Refused]]


class StepThread:
    """The one thread that runs the engine: its model loading (``call``), then every step (``start``).

    One thread for both because torch's CPU ops run on an OpenMP team that belongs to the thread
    calling them. A model loaded on the main thread and stepped on another leaves two teams; libgomp,
    then managing more threads than there are CPUs, lets idle workers sleep almost at once, and
    each of a step's many parallel regions waits for a wake-up: batch-1 steps took 9.5 ms, not 2.9.

    Once started it steps on its own while there is work, with no handoff between two steps. The
    socket loop takes the engine between two steps without waiting for one to end: ``want`` asks,
    and says whether it is granted; if not, the end of the running step is signalled on
    ``fileno()`` (it is in the loop's poller) and the next step waits for ``release``.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future, Callable[..., object], tuple] | None] = queue.SimpleQueue()
        self._turn = threading.Condition()
        self._stepping = False  # a step runs: the engine is the step's
        self.wanted = False  # the socket loop asked for the engine: no new step starts
        self._stopped = False
        self._ended_r, self._ended_w = os.pipe()  # a byte at the end of each step
        os.set_blocking(self._ended_r, False)
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn`` on the engine thread and wait for its result (before ``start``)."""
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future.result()

    def start(self, step: Callable[[], None], has_work: Callable[[], bool]) -> None:
        """Call ``step`` again and again while ``has_work()``; sleep while not (a ``release``, after
        which there may be new requests, wakes it)."""
        self._jobs.put((Future(), self._loop, (step, has_work)))

    def fileno(self) -> int:
        return self._ended_r

    def clear(self) -> None:
        """Forget the ends signalled so far (the outputs of those steps are posted already)."""
        try:
            while os.read(self._ended_r, 4096):
                pass
        except BlockingIOError:
            pass

    def want(self) -> bool:
        """Ask for the engine; True when it is granted (no step runs, and none starts until
        ``release``). Not granted: the running step's end is signalled on ``fileno()``."""
        with self._turn:
            self.wanted = True
            return not self._stepping

    def release(self) -> None:
        with self._turn:
            self.wanted = False
            self._turn.notify_all()

    def stop(self) -> None:
        """Let the step that runs end, then end the thread."""
        with self._turn:
            self._stopped = True
            self._turn.notify_all()
        self._jobs.put(None)
        self._thread.join()
        os.close(self._ended_r)
        os.close(self._ended_w)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn, args = job
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller of ``call``
                future.set_exception(exc)

    def _loop(self, step: Callable[[], None], has_work: Callable[[], bool]) -> None:
        while True:
            with self._turn:
                while not self._stopped and (self.wanted or not has_work()):
                    self._turn.wait()
                if self._stopped:
                    return
                self._stepping = True
            try:
                step()
            finally:
                with self._turn:
                    self._stepping = False
                os.write(self._ended_w, b".")


class CapacityMeter:
    """Tokens per second of busy step time, averaged over the last CAPACITY_WINDOW_S of steps. The
    gateways weigh a worker's outstanding work by it, so a worker twice as fast gets twice the work."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self.last = -math.inf

    def add(self, tokens: int, seconds: float) -> None:
        keep = math.exp(-seconds / CAPACITY_WINDOW_S)
        self.tokens = self.tokens * keep + tokens
        self.seconds = self.seconds * keep + seconds
        self.last = time.monotonic()

    @property
    def tokens_per_s(self) -> float:
        """0 (unknown: the gateway assumes a typical speed) when nothing ran for CAPACITY_STALE_S, so
        a figure taken under other load does not keep an idle worker from being picked."""
        if self.seconds <= 0 or time.monotonic() - self.last > CAPACITY_STALE_S:
            return 0.0
        return self.tokens / self.seconds


class WorkerProc:
    """Connects to every gateway, registers, and runs the engine loop until told to stop."""

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
        tokenizer: TokenizerBundle | None = None,
        stepper: StepThread | None = None,
    ) -> None:
        """``stepper``: the thread the engine was built on (see StepThread); a new one otherwise."""
        self.curve_keys = curve_keys  # (own secret key file, gateway public key file)
        self.engine = engine
        self.addresses = address
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.tokenizer = tokenizer
        self.ready = Ready(
            worker_name=self.name,
            model=model,
            max_model_len=engine.max_model_len,
            kv_capacity_tokens=engine.blocks.capacity_tokens,
            block_size=engine.blocks.block_size,
            max_batch_size=engine.max_num_seqs,
            device=device,
            dtype=dtype,
            tokenizer_digest=tokenizer.digest if tokenizer else "",
        )
        self.interval = heartbeat_interval
        self.liveness = heartbeat_liveness
        self.context = zmq.Context.instance()
        self.stopping = False
        self.drain_timeout = drain_timeout
        self.draining_since: float | None = None
        self.links: dict[str, GatewayLink] = {}
        self.owner: dict[str, GatewayLink] = {}  # request id -> the gateway that sent it
        self.capacity = CapacityMeter()
        self._resolved = resolve_gateways(address)
        self._resolver: threading.Thread | None = None
        self._inbox: Inbox = []  # what arrived for the engine, applied between steps
        self._stepper = stepper or StepThread()
        self._outbox: deque[StepOutputs] = deque()  # outputs of the steps that ended, to send
        self._held_load = Heartbeat()  # the engine's load when the socket loop last held it

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.drain())

    def drain(self) -> None:
        """First call: finish the current requests, take no new ones, then leave. Second: leave now."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()  # a step may be running: read no engine state here
            log.info("draining: finishing %d requests, taking no new ones", len(self.owner))
        else:
            self.stopping = True

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve every gateway until stopped; reconnect each one that goes silent, with backoff."""
        self._resolver = threading.Thread(target=self._resolve_loop, name="resolve-gateways", daemon=True)
        self._resolver.start()
        self._stepper.start(self._step, self.engine.has_work)
        try:
            while not self.stopping:
                self._serve_once()
        finally:
            self._stepper.stop()
            self._send_outputs()
            for link in list(self.links.values()):
                if link.sock is not None:
                    self._send(link, Goodbye("shutting down"))
                    self._close(link, linger=500)
            dropped = self.engine.fail_all("worker stopped")
            if dropped:
                log.warning("stopped with %d requests unfinished", len(dropped))

    def _serve_once(self) -> None:
        """One turn: (re)connect links; send the outputs of the steps that ended; when there is
        something for the engine (requests, aborts, a heartbeat due, a silent gateway, a drain),
        take it between two steps, or ask for it at the running step's end; then wait for messages,
        a step's end or a timer, and read the messages (answering what needs no engine)."""
        now = time.monotonic()
        self._update_links(now)
        self._stepper.clear()
        self._send_outputs()
        if (self._stepper.wanted or self._needs_engine(now)) and self._stepper.want():
            try:
                self._tend_engine()
            finally:
                self._stepper.release()
            if self.stopping:
                return
        elif self._heartbeat_due(now):  # a step runs (it may be long): say we are alive meanwhile
            self._send_heartbeats(now, self._load_during_step())
        now = time.monotonic()
        poller = zmq.Poller()
        poller.register(self._stepper, zmq.POLLIN)
        wait_s = self.interval
        for link in self.links.values():
            if link.sock is None:
                wait_s = min(wait_s, max(0.0, link.retry_at - now))
                continue
            self._flush(link)
            poller.register(link.sock, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
            wait_s = min(wait_s, max(0.0, link.next_heartbeat - now))
            if link.unsent:
                wait_s = min(wait_s, 0.01)
        events = dict(poller.poll(int(wait_s * 1000)))
        for link in list(self.links.values()):
            if link.sock is not None and (link.sock in events or link.monitor in events):
                self._read_monitor(link)
                if self._drain_socket(link) and not link.heard:  # the gateway only talks to workers it registered
                    log.info("registered with the gateway at %s as %s", link.address, self.name)
                    link.heard = True

    def _needs_engine(self, now: float) -> bool:
        return bool(self._inbox) or self.draining_since is not None or self._heartbeat_due(now) or self._silent(now)

    def _tend_engine(self) -> None:
        """The engine is ours between two steps: hand it what arrived, end a drain that is done,
        drop silent gateways' requests, and send the heartbeats that are due."""
        self._send_outputs()  # every step that ended: before any abort's outputs or heartbeat
        self._apply_inbox()
        now = time.monotonic()
        if self.draining_since is not None and (not self.engine.has_work() or now - self.draining_since > self.drain_timeout):
            self.stopping = True
            return
        self._judge_silences(now)
        self._held_load = self._with_own_figures(self.engine.load())
        self._send_heartbeats(now, self._held_load)

    def _heartbeat_due(self, now: float) -> bool:
        return any(link.sock is not None and now >= link.next_heartbeat for link in self.links.values())

    def _silent(self, now: float, link: GatewayLink | None = None) -> bool:
        """Whether a connected gateway (``link``, or any) has been silent past its liveness."""
        links = self.links.values() if link is None else [link]
        return any(one.sock is not None and now - one.last_heard > self.interval * self.liveness for one in links)

    def _judge_silences(self, now: float) -> None:
        """Engine held: drop every gateway silent for too long (its requests are aborted)."""
        for link in list(self.links.values()):
            if self._silent(now, link):
                self._drain_socket(link)  # read what is waiting before judging
                now = time.monotonic()
                if self._silent(now, link):
                    log.warning("no word from the gateway at %s for %.1f s", link.address, now - link.last_heard)
                    self._disconnect(link, now)

    def _send_heartbeats(self, now: float, load: Heartbeat) -> None:
        """The outputs of the steps that ended sent: ``load`` to every gateway whose heartbeat is
        due (a gateway must never see a heartbeat before the outputs that came before it: it would
        take a finished request for a lost one)."""
        for link in self.links.values():
            if link.sock is None:
                continue
            if self.draining_since is not None and not link.announced_drain:
                link.announced_drain, link.next_heartbeat = True, now  # tell the gateway right away
            if now >= link.next_heartbeat:
                self._send(link, load)
                link.next_heartbeat = now + self.interval

    def _load_during_step(self) -> Heartbeat:
        """The load while a step runs (the engine is not ours to read): as at the last hand-over,
        with the requests that arrived since counted as waiting. It may count requests that have
        finished since, never fewer than the worker holds: a gateway resumes elsewhere the
        requests a worker says it does not hold."""
        arrived = sum(len(msg.requests) for _, msg in self._inbox if isinstance(msg, AddRequests))
        return self._with_own_figures(dataclasses.replace(self._held_load, waiting=self._held_load.waiting + arrived))

    def _with_own_figures(self, load: Heartbeat) -> Heartbeat:
        """``load`` with the figures the socket side keeps: whether it drains, and its speed."""
        load.draining = self.draining_since is not None
        load.capacity_tokens_per_s = round(self.capacity.tokens_per_s, 1)
        return load

    def _step(self) -> None:
        """On the engine thread: one step, its outputs posted for the socket loop to send."""
        start = time.perf_counter()
        try:
            step = self.engine.step()
        except Exception as exc:  # a failed step must not kill the worker or leak blocks
            log.exception("step failed")
            step = StepOutputs(self.engine.fail_all(f"step failed: {type(exc).__name__}: {exc}"))
        tokens = sum(len(o.new_token_ids) for o in step.outputs)
        if tokens:
            self.capacity.add(tokens, time.perf_counter() - start)
        self._outbox.append(step)

    def _send_outputs(self) -> None:
        """Send the outputs of every step that ended so far, in order."""
        while self._outbox:
            self._deliver(self._outbox.popleft())

    def _deliver(self, step: StepOutputs) -> None:
        """Send each gateway the outputs of its own requests (all in one message per gateway)."""
        parts: dict[str, list[RequestOutput]] = {}
        for output in step.outputs:
            link = self.owner.get(output.request_id)
            if output.finish_reason is not None:
                self.owner.pop(output.request_id, None)
                if link is not None:
                    link.requests.discard(output.request_id)
            if link is not None and link.sock is not None:
                parts.setdefault(link.address, []).append(output)
        for address, outputs in parts.items():
            self._send(self.links[address], StepOutputs(outputs, step.batch_size, step.num_tokens))

    # ---- links ---------------------------------------------------------------------------------

    def _resolve_loop(self) -> None:
        """Resolve the gateway names again every liveness period (DNS can take seconds: not in the
        step loop). The step loop picks the new list up in ``_update_links``."""
        while not self.stopping:
            time.sleep(max(1.0, self.interval * self.liveness))
            self._resolved = resolve_gateways(self.addresses)

    def _update_links(self, now: float) -> None:
        resolved = set(self._resolved)
        for address in resolved - self.links.keys():
            if self.draining_since is None:
                self.links[address] = GatewayLink(address)
                if len(self.links) > 1:
                    log.info("gateway %s found; serving %d gateways", address, len(self.links))
        for address, link in list(self.links.items()):
            link.resolved = address in resolved
            if link.sock is None and not link.resolved:
                del self.links[address]  # gone from the name and not connected: forget it
            elif link.sock is None and now >= link.retry_at and self.draining_since is None:
                self._connect(link)

    def _connect(self, link: GatewayLink) -> None:
        sock = self.context.socket(zmq.DEALER)
        # A fresh identity per connection: the gateway may still hold the old one until it expires.
        sock.setsockopt(zmq.IDENTITY, f"{self.name}/{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.curve_keys:
            own_public, own_secret = zmq.auth.load_certificate(self.curve_keys[0])
            server_public, _ = zmq.auth.load_certificate(self.curve_keys[1])
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = own_public, own_secret, server_public
        link.monitor = sock.get_monitor_socket(protocol.HANDSHAKE_EVENT_MASK)
        link.handshakes_seen = set()
        sock.connect(link.address)
        link.sock = sock
        link.unsent.clear()  # meant for the old connection; the gateway resumes those requests itself
        link.heard, link.last_heard, link.next_heartbeat, link.announced_drain = False, time.monotonic(), 0.0, False
        self._send(link, self.ready)
        log.info("connecting to the gateway at %s as %s", link.address, self.name)

    def _disconnect(self, link: GatewayLink, now: float) -> None:
        """The gateway went silent: drop its requests (it moved them already) and close; connect
        again after a backoff, or forget it if its address no longer resolves."""
        dropped = [request_id for request_id in link.requests if self.owner.get(request_id) is link]
        for request_id in dropped:
            self.owner.pop(request_id, None)
        link.requests.clear()
        if dropped:
            self.engine.abort(dropped)
            log.warning("gateway %s silent: dropped its %d requests", link.address, len(dropped))
        self._close(link, linger=0)
        link.backoff = 1.0 if link.heard else min(link.backoff * 2, MAX_BACKOFF_S)
        link.retry_at = now + link.backoff
        if not link.resolved:
            del self.links[link.address]
        else:
            log.info("reconnecting to %s in %.0f s", link.address, link.backoff)

    def _close(self, link: GatewayLink, linger: int) -> None:
        if link.sock is None:
            return
        link.sock.disable_monitor()
        link.monitor.close(linger=0)
        link.sock.close(linger=linger)
        link.sock = link.monitor = None

    def _read_monitor(self, link: GatewayLink) -> None:
        """Say how the handshake went, once per outcome and connection (zmq retries every 100 ms)."""
        while link.monitor.poll(0):
            event = recv_monitor_message(link.monitor)["event"]
            if event in link.handshakes_seen:
                continue
            link.handshakes_seen.add(event)
            outcome = protocol.HANDSHAKE_EVENTS.get(event, str(event))
            if event == protocol.HANDSHAKE_SUCCEEDED:
                log.debug("handshake with the gateway at %s %s", link.address, outcome)
            else:
                log.error("handshake with the gateway at %s %s", link.address, outcome)

    # ---- messages ------------------------------------------------------------------------------

    def _drain_socket(self, link: GatewayLink) -> bool:
        """Read every message waiting on a link (a step may be running: what is for the engine
        waits in the inbox); True if anything valid arrived."""
        got = False
        while True:
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return got
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as exc:
                msg = self._salvage(link, frames, exc)
                if msg is None:
                    continue
            if isinstance(msg, WorkerError):  # a refusal (a live worker has our name): the link stays silent and retries
                log.error("the gateway at %s: %s", link.address, msg.message)
                continue
            got = True
            link.last_heard = time.monotonic()
            if isinstance(msg, AddRequests | Abort):
                self._inbox.append((link, msg))
            elif isinstance(msg, DescribeModel):
                self._describe(link)
            elif not isinstance(msg, Heartbeat):
                log.warning("unexpected %s from the gateway at %s", type(msg).__name__, link.address)

    def _apply_inbox(self) -> None:
        """Engine held: hand it what arrived, in order; aborted requests' final outputs go back to
        the gateways that asked."""
        inbox, self._inbox = self._inbox, []
        for link, msg in inbox:
            if link.sock is None:
                continue  # the link closed since: its gateway has moved those requests
            if isinstance(msg, AddRequests):
                for new in msg.requests:
                    self._own(link, new.request_id)
                    self.engine.add_request(new)
            elif isinstance(msg, Refused):
                for request_id, why in msg.request_ids_and_reasons:
                    self._own(link, request_id)
                    self.engine.reject(request_id, why, bad_request=True)
            else:
                self._send(link, StepOutputs(self.engine.abort(msg.request_ids)))
                for request_id in msg.request_ids:
                    if self.owner.get(request_id) is link:
                        del self.owner[request_id]
                    link.requests.discard(request_id)

    def _own(self, link: GatewayLink, request_id: str) -> None:
        self.owner[request_id] = link
        link.requests.add(request_id)

    def _describe(self, link: GatewayLink) -> None:
        """Send the model's tokenizer and chat template: the gateway has no files of its own."""
        if self.tokenizer is None:
            self._send(link, WorkerError(f"worker {self.name} has no tokenizer bundle to describe {self.ready.model}"))
            return
        bundle = self.tokenizer
        self._send(link, ModelInfo(self.ready.model, bundle.digest, bundle.packed, bundle.chat_template))

    def _salvage(self, link: GatewayLink, frames: list[bytes], exc: protocol.ProtocolError) -> AddRequests | None:
        """A message that did not decode: if it is an AddRequests, keep the requests that do decode
        and answer the others with an error (the gateway would otherwise wait on them until its
        timeout); anything else is dropped."""
        salvaged = protocol.salvage_requests(frames)
        if salvaged is None:
            log.warning("dropped a malformed message: %s", exc)
            return None
        good, bad = salvaged
        log.warning("an AddRequests did not decode (%s): %d of its requests run, %d are refused", exc, len(good), len(bad))
        self._inbox.append((link, Refused(bad)))
        return AddRequests(good)

    def _send(self, link: GatewayLink, msg: protocol.Message) -> None:
        """Never block the step loop on a slow gateway, and never lose a message either (a lost
        output is a gap in a stream): what the socket can't take now waits for the next try."""
        if not link.unsent:
            try:
                link.sock.send_multipart(protocol.encode(msg), zmq.NOBLOCK)
                return
            except zmq.Again:
                log.warning("gateway %s not accepting messages; holding them until it does", link.address)
        link.unsent.append(protocol.encode(msg))

    def _flush(self, link: GatewayLink) -> None:
        """Send what was held back, oldest first, as far as the socket takes it."""
        while link.unsent:
            try:
                link.sock.send_multipart(link.unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            link.unsent.popleft()
