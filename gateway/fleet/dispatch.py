"""Dispatch: which worker runs each request, and what becomes of it when that worker fails. No
sockets: the ROUTER side (gateway/fleet/worker_client.py) feeds it decoded messages, the HTTP side
submits and aborts, a clock says the time, and its decisions come out as messages in ``outbox``
(and as outputs or errors on each request's stream).

Requests go only to workers of their model (``ModelPool.choose``, or prefix affinity, or a ``Pin``). Any message
from a worker counts as its heartbeat; a worker silent for ``liveness`` intervals, one that says
``Goodbye``, one the ROUTER can no longer reach, or one that holds requests and makes no progress
for ``hung_timeout`` is purged. Each of its in-flight requests is then resumed on another worker
(gateway/fleet/recovery.py), so the client's stream simply continues. A gap in a request's output
numbers (a lost message) resumes it the same way. Submits made before a ``flush`` travel to a worker in
one ``AddRequests`` message.
"""

from __future__ import annotations

import hashlib
import logging
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from contextvars import ContextVar

from common.protocol import (
    Abort,
    AddRequests,
    FinishReason,
    Goodbye,
    Heartbeat,
    Message,
    ModelInfo,
    NewRequest,
    Ready,
    StepOutputs,
    WorkerError,
)
from gateway.errors import BadGeneration, GenerationFailed, NoWorkerAvailable
from gateway.fleet.lora import preferring
from gateway.fleet.recovery import Recovery
from gateway.fleet.roster import GATEWAY_HEARTBEAT, Admitted, Outbox, Roster
from gateway.fleet.workers import UNTRACED, PrefixAffinity, RequestStream, Trace, WorkerInfo

log = logging.getLogger(__name__)


class Pin:
    """The worker a client's requests stay on while it can take them (a Responses WebSocket: its KV
    stays warm); the first request's worker is chosen as any other's. ``/workers`` counts each
    worker's open pins (``pinned_sockets``) until the socket closes (``open`` False)."""

    identity: bytes | None = None
    open: bool = True


# The pin of the task submitting (set by the WebSocket route; tasks it starts inherit it).
PINNED: ContextVar[Pin | None] = ContextVar("llmpool_pinned_worker", default=None)


class Dispatcher:
    """Where each request goes, and the workers' messages about it; a request whose worker fails
    moves through ``recovery`` (gateway/fleet/recovery.py)."""

    def __init__(
        self,
        interval: float,
        liveness: int,
        max_retries: int = 2,
        hung_timeout: float = 60.0,
        affinity_slack: int | None = 2048,
        learns: bool = False,
        reachable: Callable[[bytes], bool] = lambda identity: True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.liveness = liveness
        self.max_retries = max_retries
        self.hung_timeout = hung_timeout
        self.clock = clock
        self.outbox: Outbox = deque()  # (identity, message) to send, in order
        self.to_learn: list[tuple[bytes, ModelInfo]] = []  # tokenizers to load (then ``learned``)
        self.roster = Roster(interval, liveness, learns, reachable, self.outbox)
        self.affinity = PrefixAffinity(affinity_slack) if affinity_slack is not None else None
        self.streams: dict[str, RequestStream] = {}
        self.pins: weakref.WeakSet[Pin] = weakref.WeakSet()  # the WebSockets' pins (their worker, in /workers)
        self.add_messages_sent = 0
        self.recovery = Recovery(
            self.roster, self.outbox, self.streams, clock, liveness, max_retries, self._assign, self.end
        )
        self._with_pending: dict[bytes, WorkerInfo] = {}  # workers with requests to send at the next flush
        self._last_tick = clock()

    @property
    def resumed(self) -> int:
        """Requests moved to another worker after theirs died."""
        return self.recovery.resumed

    # ---- what the HTTP side asks -------------------------------------------------------------

    def ready_workers(self) -> list[WorkerInfo]:
        """Workers taking requests and making progress on the ones they hold (for /ready)."""
        now = self.clock()
        return [
            w for w in self.roster.workers.values() if not w.load.draining and not w.stalled(now, self.hung_timeout / 2)
        ]

    def snapshot(self) -> dict:
        pinned = Counter(pin.identity for pin in self.pins if pin.open)
        return {
            **self.roster.snapshot(pinned),
            "inflight": len(self.streams),
            "add_messages_sent": self.add_messages_sent,
            "resumed": self.resumed,
            "affinity_hits": self.affinity.hits if self.affinity else 0,
            "store_routed": self.affinity.store_routed if self.affinity else 0,
        }

    def submit(
        self, request: NewRequest, model: str, trace: Trace = UNTRACED, delivered: list[int] | None = None
    ) -> RequestStream:
        """Queue a request for a worker of ``model`` (sent at the next ``flush``); its outputs arrive
        on the returned stream. ``delivered``: tokens another gateway already delivered (it died):
        the request continues after them as a dead worker's requests resume, its counts as if it had
        run here throughout."""
        if not self.roster.available(model, self.clock()):
            raise NoWorkerAvailable(
                f"no worker of `{model}` is taking requests; start one with `llmpool worker --model ...`"
            )
        stream = RequestStream(request, model, trace)
        self.streams[request.request_id] = stream
        if delivered:
            stream.generated, stream.offset = list(delivered), len(delivered)
            request = stream.resumed_request()
            if request.max_new_tokens <= 0:
                self.recovery.finish_delivered(stream)
                return stream
        self._assign(stream, request)
        return stream

    def abort(self, request_id: str) -> None:
        """Forget a request and tell its worker to stop it (the client left, or a stop string hit)."""
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        worker = self.roster.workers.get(stream.worker)
        if worker is None:
            return
        worker.release(stream)
        if any(r.request_id == stream.wire_id for r in worker.pending):  # not sent yet: just drop it
            worker.pending = [r for r in worker.pending if r.request_id != stream.wire_id]
            return
        self.outbox.append((worker.identity, Abort([stream.wire_id])))

    def flush(self) -> None:
        """Every worker's pending requests, as one AddRequests message each."""
        with_pending, self._with_pending = self._with_pending, {}
        for worker in with_pending.values():
            if worker.pending and worker.identity in self.roster.workers:
                batch, worker.pending = worker.pending, []
                self.add_messages_sent += 1
                self.outbox.append((worker.identity, AddRequests(batch)))

    def _assign(self, stream: RequestStream, request: NewRequest) -> None:
        """The worker of the request's model expected to finish it first (``ModelPool.choose``),
        unless prefix affinity points at one that probably holds this prompt's prefix in its KV
        cache and is not much busier."""
        pool = self.roster.models[stream.model]
        stream.cost = len(request.prompt_token_ids) + request.max_new_tokens
        worker = pool.choose(stream.cost, self.clock(), None if request.lora is None else preferring(request.lora))
        pin = PINNED.get()
        pinned = pool.taking(pin.identity) if pin is not None and pin.identity is not None else None
        if pinned is not None:  # a WebSocket's requests stay on its worker
            worker = pinned
        elif request.affinity_key is not None and request.lora is None:  # a session's key, ahead of prefix hashing
            slack = self.affinity.slack if self.affinity is not None else 2048
            worker = keyed_worker(request.affinity_key, pool.available(self.clock()), worker, slack)
        elif self.affinity is not None and request.lora is None:  # an adapter's request: where the adapter is
            salted = stream.model if request.cache_salt is None else f"{stream.model}\x00{request.cache_salt}"
            worker = self.affinity.choose(
                salted, request.prompt_token_ids, lambda identity: pool.taking(identity), worker
            )
        if pin is not None:
            pin.identity = worker.identity
            self.pins.add(pin)
        worker.outstanding_tokens += stream.cost
        if not worker.inflight:
            worker.last_progress = self.clock()  # the progress clock starts with the work
        worker.inflight.add(stream.request_id)
        worker.requests_assigned += 1
        stream.heartbeats_at_assign = worker.heartbeats
        stream.next_seq = 0
        worker.pending.append(request)
        self._with_pending[worker.identity] = worker
        stream.worker = worker.identity
        stream.trace.assigned(worker.ready.worker_name)

    # ---- what the workers say ----------------------------------------------------------------

    def on_message(self, identity: bytes, msg: Message) -> None:
        now = self.clock()
        if isinstance(msg, Ready):
            self._admitted(self.roster.register(identity, msg, now))
            return
        worker = self.roster.workers.get(identity)
        if worker is None:
            if identity in self.roster.joining:
                self._joining(identity, msg, now)
            elif isinstance(msg, WorkerError):  # a worker that could not load its model says why, then exits
                self.roster.start_failures.note(identity, msg.message)
            else:
                log.debug("message from unregistered peer %r ignored; it will re-register", identity[:64])
            return
        worker.expiry = now + self.interval * self.liveness
        if isinstance(msg, StepOutputs):
            self._on_step(worker, msg, now)
        elif isinstance(msg, Heartbeat):
            if msg.draining != worker.load.draining:
                self.roster.models[worker.ready.model].changed()
            worker.load = msg
            worker.heartbeats += 1
            if worker.inflight and not (msg.running or msg.waiting):
                self.recovery.recover_unheld(worker)
        elif isinstance(msg, Goodbye):
            self._purge(worker, f"worker {worker.ready.worker_name} left: {msg.reason}")
        elif isinstance(msg, WorkerError):
            log.error("worker %s: %s", worker.ready.worker_name, msg.message)
            stream = self._stream_of(msg.request_id)
            if stream is not None:
                self.end(stream, GenerationFailed(msg.message))

    def _joining(self, identity: bytes, msg: Message, now: float) -> None:
        info = self.roster.joining_message(identity, msg, now)
        if info is None:
            return
        if self.roster.models[info.model].learning:
            self.to_learn.append((identity, info))
        else:  # known already (another worker's answer was loaded): admit at once
            self.learned(identity, info, None)

    def learned(self, identity: bytes, info: ModelInfo, error: Exception | None) -> None:
        """The ROUTER side loaded (or failed to load, ``error``) a tokenizer from ``to_learn``."""
        for admitted in self.roster.learned(identity, info, error, self.clock()):
            self._admitted(admitted)

    def _admitted(self, admitted: Admitted | None) -> None:
        if admitted is None:
            return
        if admitted.stale is not None:  # after adding the new one, so its requests can resume right there
            self._purge(
                admitted.stale,
                f"worker {admitted.worker.ready.worker_name} registered again (restarted or reconnected)",
            )
        self.recovery.adopt(admitted.worker.ready.model)

    def unreachable(self, identity: bytes, reason: str) -> None:
        """A send to this worker failed (EHOSTUNREACH under ROUTER_MANDATORY, or its queue is full)."""
        worker = self.roster.workers.get(identity)
        if worker is not None:
            self._purge(worker, f"worker {worker.ready.worker_name} is unreachable ({reason})")

    def _on_step(self, worker: WorkerInfo, step: StepOutputs, now: float) -> None:
        worker.last_progress = now
        if step.batch_size:
            worker.steps_seen += 1
            worker.batched_steps += step.batch_size > 1
            worker.peak_batch_size = max(worker.peak_batch_size, step.batch_size)
        for output in step.outputs:
            stream = self._stream_of(output.request_id)
            if stream is None:
                continue  # aborted by us already, or from an attempt that was moved on
            if output.seq != stream.next_seq:
                self.recovery.lost_output(worker, stream, output.seq)
                continue
            stream.next_seq += 1
            if output.events:  # only a traced request brings any
                stream.trace.worker_events(output.events, worker.ready.worker_name)
            if output.finish_reason == FinishReason.ERROR:
                failure = BadGeneration if output.bad_request else GenerationFailed
                self.end(stream, failure(output.error or "the worker failed this request"))
                continue
            stream.deliver(output)
            if output.finish_reason is not None:
                self.end(stream, None)

    def _stream_of(self, wire_id: str | None) -> RequestStream | None:
        """The open stream whose current attempt has this wire id (None for a stale attempt's)."""
        stream = self.streams.get(wire_id) if wire_id is not None else None
        stream = stream or self.recovery.attempts.get(wire_id or "")
        return stream if stream is not None and stream.wire_id == wire_id else None

    # ---- endings and moves -------------------------------------------------------------------

    def end(self, stream: RequestStream, error: GenerationFailed | None = None) -> None:
        """Close a stream (with an error to deliver, or after its final output)."""
        self.streams.pop(stream.request_id, None)
        self.recovery.attempts.pop(stream.wire_id, None)
        worker = self.roster.workers.get(stream.worker)
        if worker is not None:
            worker.release(stream)
        if error is not None and not stream.finished:
            stream.queue.put_nowait(error)
        stream.finished = True

    def _purge(self, worker: WorkerInfo, reason: str) -> None:
        if not self.roster.remove(worker, reason):
            return
        self._with_pending.pop(worker.identity, None)
        log.warning("%s; resuming its %d in-flight requests elsewhere", reason, len(worker.inflight))
        self.recovery.worker_lost(worker, reason)

    def tick(self) -> None:
        """Every heartbeat interval: judge the workers (expired, hung), end orphans that waited too
        long, tend the joiners, and heartbeat every worker still registered."""
        now = self.clock()
        self.roster.forgive(now - self._last_tick - self.interval)
        self._last_tick = now
        self.recovery.expire(now, self.interval * self.liveness)
        self.roster.tend_joiners(now)
        for worker in list(self.roster.workers.values()):
            if now > worker.expiry:
                self._purge(worker, f"worker {worker.ready.worker_name} missed {self.liveness} heartbeats")
            elif worker.stalled(now, self.hung_timeout):
                # Alive (heartbeats arrive) but its engine produces nothing: a hung step.
                self._purge(worker, f"worker {worker.ready.worker_name} made no progress for {self.hung_timeout:g} s")
            else:
                self.outbox.append((worker.identity, GATEWAY_HEARTBEAT))

    def stop(self, reason: str) -> None:
        """End every open request with ``reason``."""
        for stream in list(self.streams.values()):
            self.end(stream, GenerationFailed(reason))


def keyed_worker(key: str, workers: list[WorkerInfo], best: WorkerInfo, slack: int) -> WorkerInfo:
    """The worker an affinity key (``prompt_cache_key``, ``x-session-id``) belongs to: the highest
    of a stable hash of the key and each worker's name (rendezvous hashing), so every gateway picks
    the same one and a worker leaving moves only its own keys; ``best`` instead when that worker
    is more than ``slack`` tokens busier."""
    if not workers:
        return best

    def weight(worker: WorkerInfo) -> bytes:
        return hashlib.blake2b(f"{key}\x00{worker.ready.worker_name}".encode(), digest_size=8).digest()

    owner = max(workers, key=weight)
    return owner if owner.outstanding_tokens <= best.outstanding_tokens + slack else best
