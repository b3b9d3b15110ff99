"""The gateway's ROUTER socket: worker registry, heartbeats, request dispatch and output routing.

Workers connect (DEALER) and register with ``Ready``, naming their model. The first worker of a
model whose tokenizer this gateway does not hold is asked for it (``DescribeModel``; it answers
``ModelInfo``); until the gateway has loaded it, that model's workers wait in ``joining``. A worker
whose tokenizer differs from the one its model name already has here is refused, and so is one whose
name a live worker holds (it is told why, in a ``WorkerError``). Requests go only
to workers of their model (``ModelPool`` chooses among them). Any message from a worker counts as its
heartbeat; a worker silent for ``liveness`` intervals, one that says ``Goodbye``, or one the ROUTER
can no longer reach (ROUTER_MANDATORY makes such sends fail loudly) is purged. Each of its in-flight
requests is then resumed on another worker as prompt plus the tokens already delivered, with the
remaining budget and the same sampling settings, so the client's stream simply continues; only when
no worker is left, or a request has been moved ``max_retries`` times, does it end with an error.
One receive task feeds every request's queue; submits made in the same event-loop tick travel to a
worker in one ``AddRequests`` message.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
import zmq.auth
import zmq.auth.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from common import protocol
from common.protocol import (
    Abort,
    AddRequests,
    DescribeModel,
    FinishReason,
    Goodbye,
    Heartbeat,
    ModelInfo,
    NewRequest,
    Ready,
    RequestOutput,
    StepOutputs,
    WorkerError,
)
from gateway import tracing
from gateway.errors import BadGeneration, GenerationFailed, NoWorkerAvailable
from gateway.pool import ModelPool, PrefixAffinity, RequestStream, StartFailures, WorkerInfo

log = logging.getLogger(__name__)

_HEARTBEAT = protocol.encode(Heartbeat())  # the gateway's heartbeat carries nothing: encode it once


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
        self.curve_secret_key = curve_secret_key
        self.curve_authorized_keys = curve_authorized_keys
        self._authenticator: zmq.auth.asyncio.AsyncioAuthenticator | None = None
        self.hung_timeout = hung_timeout
        self.affinity = PrefixAffinity(affinity_slack) if affinity_slack is not None else None
        self.bind_address = bind_address
        # Loads a model's tokenizer from a worker's ModelInfo (raises if it can't); None: take the
        # digest on trust (unit tests of the socket side, the fleet benchmark).
        self.learn_model = learn_model
        self.max_retries = max_retries
        self.resumed = 0  # requests moved to another worker after theirs died
        self.interval = heartbeat_interval
        self.liveness = heartbeat_liveness
        self.workers: dict[bytes, WorkerInfo] = {}
        self.models: dict[str, ModelPool] = {}
        self.joining: dict[bytes, tuple[Ready, float]] = {}  # registered, waiting for their model's tokenizer: (Ready, last heard)
        self._refused: set[tuple[str, str]] = set()  # (worker name, why) already logged
        self._with_pending: dict[bytes, WorkerInfo] = {}  # workers with requests to send at the end of this tick
        self.streams: dict[str, RequestStream] = {}
        self.add_messages_sent = 0
        self.dropped_frames = 0
        self.departed: deque[dict] = deque(maxlen=16)  # recently dropped workers, for operators
        self.departures = 0  # registrations dropped since start (left, died, unreachable, replaced)
        self.start_failures = StartFailures()  # workers that said why they could not start (/health)
        # Requests whose worker died when no other was there: they wait a liveness period for one
        # to (re)register (workers reconnect after a gateway pause or restart) before failing.
        self._orphans: dict[str, tuple[RequestStream, str, float]] = {}
        self._attempts: dict[str, RequestStream] = {}  # resumed requests by their current wire id
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._identity_of: dict[str, bytes] = {}  # worker name -> its registered identity (one per name)
        self._tasks: list[asyncio.Task] = []
        self._flush_scheduled = False
        self._busy = asyncio.Event()  # set when a request arrives: ends the receive loop's idle pause

    async def start(self) -> None:
        sock = self._context.socket(zmq.ROUTER)
        if self.curve_secret_key:
            self._enable_curve(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.bind_address)
        self._socket = sock
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._heartbeat_loop())]
        if self.curve_secret_key:
            self._tasks.append(asyncio.create_task(self._watch_handshakes(sock.get_monitor_socket(protocol.HANDSHAKE_EVENT_MASK))))
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
        for stream in list(self.streams.values()):
            self._end(stream, GenerationFailed("the gateway is shutting down"))
        if self._socket is not None:
            self._socket.close()
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # ---- what the HTTP side uses -------------------------------------------------------------

    def limits(self, model: str) -> tuple[int, int]:
        """(max_model_len, kv capacity) that every registered worker of ``model`` can take; 503 if none."""
        pool = self.models.get(model)
        if pool is None or not pool.workers:
            raise NoWorkerAvailable(f"no worker of `{model}` is registered; start one with `llmpool worker --model ...`")
        return pool.limits()

    def ready_workers(self) -> list[WorkerInfo]:
        """Workers taking requests and making progress on the ones they hold (for /ready)."""
        now = time.monotonic()
        return [w for w in self.workers.values() if not w.load.draining and not self._stalled(w, now, self.hung_timeout / 2)]

    def _stalled(self, worker: WorkerInfo, now: float, limit: float) -> bool:
        """Holding requests by its own account (its latest heartbeat) and producing nothing for
        ``limit`` s. Requests it never accepted don't count: they are not its to work on."""
        holds = worker.inflight and (worker.load.running or worker.load.waiting)
        return bool(holds) and now - worker.last_progress > limit

    def available(self, model: str) -> list[WorkerInfo]:
        """Workers of ``model`` that take new requests (registered and not draining)."""
        pool = self.models.get(model)
        return pool.available() if pool is not None else []

    def submit(self, request: NewRequest, model: str, delivered: list[int] | None = None) -> RequestStream:
        """Send a request to a worker of ``model``; its outputs arrive on the returned stream.
        ``delivered``: tokens another gateway already delivered (it died): the request continues
        after them, as a dead worker's requests resume, its counts as if it had run here throughout."""
        if not self.available(model):
            raise NoWorkerAvailable(f"no worker of `{model}` is taking requests; start one with `llmpool worker --model ...`")
        stream = RequestStream(request, model)
        self.streams[request.request_id] = stream
        self._busy.set()
        if delivered:
            stream.generated, stream.offset = list(delivered), len(delivered)
            request = stream.resumed_request()
            if request.max_new_tokens <= 0:  # every token was delivered, only the finish was lost
                final = RequestOutput(stream.request_id, [], FinishReason.LENGTH, len(stream.request.prompt_token_ids), len(delivered))
                stream.queue.put_nowait(final)
                self._end(stream, None)
                return stream
        self._assign(stream, request)
        return stream

    def _assign(self, stream: RequestStream, request: NewRequest) -> None:
        """Queue ``request`` for a worker; it is sent at the end of this loop tick.

        The worker of the request's model expected to finish it first (``ModelPool.choose``), unless
        prefix affinity points at one that probably holds this prompt's prefix in its KV cache and
        is not much busier.
        """
        pool = self.models[stream.model]
        stream.cost = len(request.prompt_token_ids) + request.max_new_tokens
        worker = pool.choose(stream.cost)
        if self.affinity is not None:
            worker = self.affinity.choose(stream.model, request.prompt_token_ids, lambda identity: self._taking(pool, identity), worker)
        worker.outstanding_tokens += stream.cost
        if not worker.inflight:
            worker.last_progress = time.monotonic()  # the progress clock starts with the work
        worker.inflight.add(stream.request_id)
        worker.requests_assigned += 1
        stream.heartbeats_at_assign = worker.heartbeats
        stream.next_seq = 0
        worker.pending.append(request)
        self._with_pending[worker.identity] = worker
        stream.worker = worker.identity
        tracing.assigned(stream.request_id, worker.ready.worker_name)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def abort(self, request_id: str) -> None:
        """Forget a request and tell its worker to stop it (the client left, or a stop string hit)."""
        stream = self.streams.pop(request_id, None)
        if stream is None or stream.finished:
            return
        stream.finished = True
        worker = self.workers.get(stream.worker)
        if worker is None:
            return
        if request_id in worker.inflight:
            worker.inflight.discard(request_id)
            worker.outstanding_tokens -= stream.cost
        if any(r.request_id == stream.wire_id for r in worker.pending):  # not sent yet: just drop it
            worker.pending = [r for r in worker.pending if r.request_id != stream.wire_id]
            return
        self._send(worker, Abort([stream.wire_id]))

    def _taking(self, pool: ModelPool, identity: bytes) -> WorkerInfo | None:
        """The worker with this identity if it is in ``pool`` and takes new requests."""
        worker = pool.workers.get(identity)
        return worker if worker is not None and not worker.load.draining else None

    def snapshot(self) -> dict:
        return {
            "workers": [w.snapshot() for w in self.workers.values()],
            "joining": [{"name": ready.worker_name, "model": ready.model} for ready, _ in self.joining.values()],
            "inflight": len(self.streams),
            "add_messages_sent": self.add_messages_sent,
            "resumed": self.resumed,
            "affinity_hits": self.affinity.hits if self.affinity else 0,
            "dropped_frames": self.dropped_frames,
            "departed": list(self.departed),
            "departures": self.departures,
        }

    # ---- socket side -------------------------------------------------------------------------

    def _flush(self) -> None:
        """Send every worker its pending requests as one AddRequests message."""
        self._flush_scheduled = False
        with_pending, self._with_pending = self._with_pending, {}
        for worker in with_pending.values():
            if worker.pending and worker.identity in self.workers:
                batch, worker.pending = worker.pending, []
                self.add_messages_sent += 1
                self._send(worker, AddRequests(batch))

    def _send_raw(self, identity: bytes, msg: protocol.Message) -> bool:
        """Send to a peer that is not (yet) a registered worker; False if it can't be reached."""
        assert self._socket is not None
        try:
            sent = self._socket.send_multipart([identity, *protocol.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return not (sent.done() and sent.exception() is not None)

    def _send(self, worker: WorkerInfo, msg: protocol.Message | list[bytes]) -> None:
        """Send without blocking (a message, or frames encoded already); a send that fails
        (EHOSTUNREACH under ROUTER_MANDATORY, or EAGAIN when the peer's queue is full) purges the
        worker; zmq.asyncio reports it through the future. (Everything goes through the asyncio
        socket: a send on a plain shadow of it can take the wake-up its receive waits for, and the
        receive loop then slept for seconds while messages waited.)"""
        assert self._socket is not None
        frames = msg if isinstance(msg, list) else protocol.encode(msg)
        try:
            sent = self._socket.send_multipart([worker.identity, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._unreachable(worker, exc)
            return
        if sent.done():
            self._check_sent(worker, sent)
        else:
            sent.add_done_callback(lambda future: self._check_sent(worker, future))

    def _check_sent(self, worker: WorkerInfo, future: asyncio.Future) -> None:
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            self._unreachable(worker, exc)

    def _unreachable(self, worker: WorkerInfo, exc: BaseException) -> None:
        reason = exc.strerror if isinstance(exc, zmq.ZMQError) else str(exc)
        self._purge(worker, f"worker {worker.ready.worker_name} is unreachable ({reason})")

    async def _receive_loop(self) -> None:
        """Await one message, then handle the messages already waiting (NOBLOCK reads finish at once)
        before letting other tasks run: a burst of heartbeats or step outputs costs one wake-up."""
        assert self._socket is not None
        while True:
            self._handle(await self._socket.recv_multipart(copy=False))
            for _ in range(self.RECEIVE_BATCH):
                try:
                    frames = await self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
            await asyncio.sleep(0)  # an await on a message already there does not yield: let the other tasks run
            if not self.streams:
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
        except protocol.ProtocolError as exc:
            self.dropped_frames += 1
            log.warning("dropped a malformed message from %r: %s", identity[:64], exc)
            return
        try:
            self._dispatch(identity, msg)
        except Exception:  # one bad message must not stop the receive loop
            log.exception("failed to handle %s", type(msg).__name__)

    def _dispatch(self, identity: bytes, msg: protocol.Message) -> None:
        if isinstance(msg, Ready):
            self._register(identity, msg)
            return
        worker = self.workers.get(identity)
        if worker is None:
            if identity in self.joining:
                self._joining_message(identity, msg)
            elif isinstance(msg, WorkerError):  # a worker that could not load its model says why, then exits
                self.start_failures.note(identity, msg.message)
            else:
                log.debug("message from unregistered peer %r ignored; it will re-register", identity[:64])
            return
        worker.expiry = time.monotonic() + self.interval * self.liveness
        if isinstance(msg, StepOutputs):
            self._on_step(worker, msg)
        elif isinstance(msg, Heartbeat):
            if msg.draining != worker.load.draining:
                self.models[worker.ready.model].changed()
            worker.load = msg
            worker.heartbeats += 1
            if worker.inflight and not (msg.running or msg.waiting):
                self._recover_unheld(worker)
        elif isinstance(msg, Goodbye):
            self._purge(worker, f"worker {worker.ready.worker_name} left: {msg.reason}")
        elif isinstance(msg, WorkerError):
            log.error("worker %s: %s", worker.ready.worker_name, msg.message)
            stream = self._stream_of(msg.request_id)
            if stream is not None:
                self._end(stream, GenerationFailed(msg.message))

    def _register(self, identity: bytes, ready: Ready) -> None:
        """A worker says hello: admit it, or (its model's tokenizer unknown here) let it join while
        the gateway learns the tokenizer, or refuse it (protocol, or a different tokenizer under a
        model name that has one)."""
        if ready.protocol_version != protocol.PROTOCOL_VERSION:
            self._refuse(identity, ready, f"it speaks protocol {ready.protocol_version}; this gateway speaks {protocol.PROTOCOL_VERSION}")
            return
        holder = self._name_holder(ready.worker_name, identity)
        if holder is not None:
            why = f"another live worker is registered as {ready.worker_name!r} ({holder.decode(errors='replace')}); give each worker its own --worker-name"
            self._refuse(identity, ready, why)
            return
        pool = self.models.setdefault(ready.model, ModelPool(ready.model))
        if pool.digest is None and self.learn_model is None:
            pool.digest = ready.tokenizer_digest  # nothing to load: take it on trust
        if pool.digest is not None and ready.tokenizer_digest != pool.digest:
            self._refuse(identity, ready, f"its tokenizer or chat template for {ready.model!r} differs from the one its other workers brought")
            return
        if pool.digest is None:
            self.joining[identity] = (ready, time.monotonic())
            self._ask_description(pool)
            return
        self._admit(identity, ready, pool)

    def _refuse(self, identity: bytes, ready: Ready, why: str) -> None:
        """Log it (once: the worker retries every liveness period) and tell the worker why."""
        if (ready.worker_name, why) not in self._refused:
            self._refused.add((ready.worker_name, why))
            log.error("refused worker %s: %s", ready.worker_name, why)
        self._send_raw(identity, WorkerError(f"the gateway refused to register this worker: {why}"))

    def _name_holder(self, name: str, identity: bytes) -> bytes | None:
        """The identity of another live worker, registered or joining, that goes by ``name``: a
        second process started with the same --worker-name. Admitting it would unregister the first,
        which re-registers and unregisters the second, endlessly. A worker that restarted or
        reconnected comes back under a new identity after its old connection closed: the old one is
        then unreachable (ROUTER_MANDATORY), or silent for two heartbeats, and is replaced."""
        now, fresh = time.monotonic(), self.interval * (self.liveness - 2)
        held = self._identity_of.get(name)
        others = [held] if held is not None and held != identity and held in self.workers and self.workers[held].expiry - now > fresh else []
        others += [
            other for other, (r, heard) in self.joining.items() if r.worker_name == name and other != identity and now - heard < 2 * self.interval
        ]
        return next((other for other in others if self._send_raw(other, Heartbeat())), None)

    def _admit(self, identity: bytes, ready: Ready, pool: ModelPool) -> None:
        self.joining.pop(identity, None)
        previous = self.workers.get(self._identity_of.get(ready.worker_name, b""))
        old = [previous] if previous is not None and previous.identity != identity else []
        worker = WorkerInfo(identity, ready, time.monotonic() + self.interval * self.liveness)
        self._identity_of[ready.worker_name] = identity
        self.workers[identity] = pool.workers[identity] = worker
        pool.changed()
        for stale in old:  # after adding the new one, so its requests can resume right there
            self._purge(stale, f"worker {ready.worker_name} registered again (restarted or reconnected)")
        for stream, reason, _ in list(self._orphans.values()):
            if stream.model == ready.model:
                self._resume(stream, reason)
        log.info(
            "worker %s registered for %s (%s, %s, %d KV tokens)", ready.worker_name, ready.model, ready.device, ready.dtype, ready.kv_capacity_tokens
        )

    def _ask_description(self, pool: ModelPool) -> None:
        """Ask one joining worker of ``pool``'s model for its tokenizer, unless one was asked within
        a liveness period (its answer may still come; a dead one is replaced by the next joiner)."""
        now = time.monotonic()
        if pool.describing is not None and pool.describing[0] in self.joining and now - pool.describing[1] < self.interval * self.liveness:
            return
        asked = next((identity for identity, (ready, _) in self.joining.items() if ready.model == pool.name), None)
        if asked is None:
            pool.describing = None
            return
        pool.describing = (asked, now)
        log.info("learning the tokenizer of %s from worker %s", pool.name, self.joining[asked][0].worker_name)
        self._send_raw(asked, DescribeModel(self.joining[asked][0].tokenizer_digest))

    def _joining_message(self, identity: bytes, msg: protocol.Message) -> None:
        ready, _ = self.joining[identity]
        self.joining[identity] = (ready, time.monotonic())
        if isinstance(msg, ModelInfo):
            task = asyncio.get_running_loop().create_task(self._learn(identity, msg))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)
        elif isinstance(msg, Goodbye):
            del self.joining[identity]
        elif isinstance(msg, WorkerError):
            log.error("worker %s: %s", ready.worker_name, msg.message)

    async def _learn(self, identity: bytes, info: ModelInfo) -> None:
        """Load the tokenizer a worker sent, then admit every joining worker that brought it."""
        pool = self.models.setdefault(info.model, ModelPool(info.model))
        if pool.learning:
            return  # another answer is being loaded; it admits the joiners
        if pool.digest is None:
            pool.learning = True
            try:
                if self.learn_model is not None:
                    await self.learn_model(info)
            except Exception as exc:
                log.error("could not load the tokenizer of %s that worker %r sent: %s", info.model, identity[:64], exc)
                self.joining.pop(identity, None)
                pool.describing = None
                self._ask_description(pool)
                return
            finally:
                pool.learning = False
            pool.digest = info.tokenizer_digest
            log.info("serving %s (tokenizer %s)", info.model, info.tokenizer_digest[:12])
        for joiner, (ready, _) in list(self.joining.items()):
            if ready.model != info.model:
                continue
            if ready.tokenizer_digest == pool.digest:
                self._admit(joiner, ready, pool)
            else:
                del self.joining[joiner]
                self._refuse(joiner, ready, f"its tokenizer or chat template for {ready.model!r} differs from the one its other workers brought")

    def _on_step(self, worker: WorkerInfo, step: StepOutputs) -> None:
        worker.last_progress = time.monotonic()
        if step.batch_size:
            worker.steps_seen += 1
            worker.batched_steps += step.batch_size > 1
            worker.peak_batch_size = max(worker.peak_batch_size, step.batch_size)
        for output in step.outputs:
            stream = self._stream_of(output.request_id)
            if stream is None:
                continue  # aborted by us already, or from an attempt that was moved on
            if output.seq != stream.next_seq:
                self._lost_output(worker, stream, output.seq)
                continue
            stream.next_seq += 1
            if output.events:  # only a traced request brings any
                tracing.worker_events(stream.request_id, output.events, worker.ready.worker_name)
            if output.finish_reason == FinishReason.ERROR:
                failure = BadGeneration if output.bad_request else GenerationFailed
                self._end(stream, failure(output.error or "the worker failed this request"))
                continue
            stream.generated.extend(output.new_token_ids)
            if stream.cached_tokens is None and output.new_token_ids:
                stream.cached_tokens = output.num_cached_tokens
            # Counts as the client sees them, whichever worker produced the tokens.
            output.num_prompt_tokens -= stream.offset
            output.num_output_tokens += stream.offset
            output.num_cached_tokens = stream.cached_tokens or 0
            stream.queue.put_nowait(output)
            if output.finish_reason is not None:
                self._end(stream, None)

    def _stream_of(self, wire_id: str | None) -> RequestStream | None:
        """The open stream whose current attempt has this wire id (None for a stale attempt's)."""
        stream = self.streams.get(wire_id) if wire_id is not None else None
        stream = stream or self._attempts.get(wire_id or "")
        return stream if stream is not None and stream.wire_id == wire_id else None

    def _lost_output(self, worker: WorkerInfo, stream: RequestStream, seq: int) -> None:
        """An output of this request never arrived (seq jumped): the tokens delivered so far are
        exact, so it resumes from them as after a dead worker, under a new wire id (the worker is
        told to stop the old attempt; whatever else it sends for it is ignored)."""
        reason = f"worker {worker.ready.worker_name} lost output {stream.next_seq} of the request (got {seq})"
        log.warning("%s; resuming it", reason, extra={"request_id": stream.request_id})
        self._send(worker, Abort([stream.wire_id]))
        self._unassign(worker, stream)
        self._resume(stream, reason)

    def _recover_unheld(self, worker: WorkerInfo) -> None:
        """The worker says it holds nothing, yet requests sent to it ``liveness`` heartbeats ago
        are open: it never accepted them (a message lost or unreadable), or their last output was
        lost. Messages from one worker arrive in order, so their outputs would have come before
        this heartbeat. Each resumes from what was delivered (``max_retries`` times at most), the
        worker is not at fault: it counts as neither hung nor dead."""
        for request_id in list(worker.inflight):
            stream = self.streams.get(request_id)
            if stream is not None and worker.heartbeats - stream.heartbeats_at_assign > self.liveness:
                reason = f"worker {worker.ready.worker_name} does not hold the request (never accepted, or its last output was lost)"
                log.warning("%s; resuming it", reason, extra={"request_id": request_id})
                self._unassign(worker, stream)
                self._resume(stream, reason)

    def _end(self, stream: RequestStream, error: GenerationFailed | None) -> None:
        """Close a stream (with an error to deliver, or after its final output)."""
        self.streams.pop(stream.request_id, None)
        self._attempts.pop(stream.wire_id, None)
        worker = self.workers.get(stream.worker)
        if worker is not None:
            self._unassign(worker, stream)
        if error is not None and not stream.finished:
            stream.queue.put_nowait(error)
        stream.finished = True

    def _unassign(self, worker: WorkerInfo, stream: RequestStream) -> None:
        if stream.request_id in worker.inflight:
            worker.inflight.discard(stream.request_id)
            worker.outstanding_tokens -= stream.cost

    def _purge(self, worker: WorkerInfo, reason: str) -> None:
        if self.workers.pop(worker.identity, None) is None:
            return
        if self._identity_of.get(worker.ready.worker_name) == worker.identity:
            del self._identity_of[worker.ready.worker_name]
        pool = self.models[worker.ready.model]
        pool.workers.pop(worker.identity, None)
        pool.changed()
        self._with_pending.pop(worker.identity, None)
        self.departed.append({"name": worker.ready.worker_name, "model": worker.ready.model, "reason": reason, "at": time.time()})
        self.departures += 1
        log.warning("%s; resuming its %d in-flight requests elsewhere", reason, len(worker.inflight))
        for request_id in list(worker.inflight):
            stream = self.streams.get(request_id)
            if stream is not None:
                self._resume(stream, reason)

    def _resume(self, stream: RequestStream, reason: str) -> None:
        """Move a request whose worker died to another one, or end it if it can't be moved."""
        if stream.finished:
            return
        if not self.available(stream.model):
            self._orphans.setdefault(stream.request_id, (stream, reason, time.monotonic()))
            return
        self._orphans.pop(stream.request_id, None)
        if stream.retries >= self.max_retries:
            self._end(stream, GenerationFailed(f"{reason}; the request was moved {stream.retries} times already"))
            return
        request = stream.resumed_request()
        if request.max_new_tokens <= 0:  # every token was delivered, only the finish was lost
            final = RequestOutput(stream.request_id, [], FinishReason.LENGTH, len(stream.request.prompt_token_ids), len(stream.generated))
            stream.queue.put_nowait(final)
            self._end(stream, None)
            return
        stream.retries += 1
        stream.offset = len(stream.generated)
        self._attempts.pop(stream.wire_id, None)
        stream.wire_id = f"{stream.request_id}.{stream.retries}"  # a late output of the old attempt can't pass for the new one's
        self._attempts[stream.wire_id] = stream
        request.request_id = stream.wire_id
        self.resumed += 1
        tracing.resumed(stream.request_id, reason, stream.retries, stream.offset)
        self._assign(stream, request)

    async def _heartbeat_loop(self) -> None:
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now = time.monotonic()
            self._forgive(now - last_tick - self.interval)
            last_tick = now
            self._end_orphans(now)
            self._tend_joiners(now)
            for worker in list(self.workers.values()):
                if now > worker.expiry:
                    self._purge(worker, f"worker {worker.ready.worker_name} missed {self.liveness} heartbeats")
                elif self._stalled(worker, now, self.hung_timeout):
                    # Alive (heartbeats arrive) but its engine produces nothing: a hung step.
                    self._purge(worker, f"worker {worker.ready.worker_name} made no progress for {self.hung_timeout:g} s")
                else:
                    self._send(worker, _HEARTBEAT)

    def _tend_joiners(self, now: float) -> None:
        """Keep joining workers alive (they count the gateway's silence too), forget silent ones, and
        ask another worker when the one asked for a tokenizer did not answer."""
        for identity, (ready, heard) in list(self.joining.items()):
            if now - heard > self.interval * self.liveness or not self._send_raw(identity, Heartbeat()):
                del self.joining[identity]
        for pool in self.models.values():
            if pool.digest is None and not pool.learning:
                self._ask_description(pool)

    async def _watch_handshakes(self, monitor: zmq.asyncio.Socket) -> None:
        """With CURVE on, log every refused handshake (a worker without keys, or with a key not in
        the authorized folder); zmq would otherwise refuse them without a word."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event != protocol.HANDSHAKE_SUCCEEDED:
                    log.warning("a worker's handshake on %s %s", self.bind_address, protocol.HANDSHAKE_EVENTS.get(event, str(event)))
        finally:
            monitor.close(linger=0)

    def _end_orphans(self, now: float) -> None:
        """Requests that waited a liveness period for a worker and got none end with their error."""
        for stream, reason, since in list(self._orphans.values()):
            if stream.finished or now - since > self.interval * self.liveness:
                del self._orphans[stream.request_id]
                self._end(stream, GenerationFailed(f"{reason}; no other worker can take the request over"))

    def _forgive(self, late: float) -> None:
        """Liveness counts the time since a worker's last message was *read*. A tick that comes
        ``late`` (this process was stopped, or its loop blocked) means nothing was read meanwhile:
        the workers' messages wait in the socket, so that time is nobody's silence. Move their
        deadlines by it; the receive loop reads the backlog before the next tick judges."""
        if late <= 0:
            return
        if late > self.interval:
            log.warning("the gateway did not run for %.1f s; not counting that against its workers", late)
        for worker in self.workers.values():
            worker.expiry += late
            worker.last_progress += late


class _Authenticator(zmq.auth.asyncio.AsyncioAuthenticator):
    """ZAP for CURVE that names the keys it refuses (pyzmq logs refusals at debug level only)."""

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            log.warning("refused a worker's CURVE key %s: %s", z85.encode(client_key).decode(), reason.decode(errors="replace"))
        return allowed, reason
