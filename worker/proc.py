"""The worker process's socket loop: one DEALER per gateway (worker/handshake.py), wrapped around the
engine that its own thread steps (worker/stepper.py).

The worker schedules its own steps (no round trip to a gateway per token), and its steps overlap
the socket work (async scheduling, vLLM's engine-core split): the engine thread steps whenever the
engine has work, without waiting for anyone, and posts each step's outputs; this loop sends them
while the next step runs, and reads what arrives. To hand the engine new requests and aborts, read
its load for a heartbeat (worker/heartbeat.py), or drop a silent gateway's requests, the loop takes
the engine between two steps, without waiting for the running one to end (``StepThread.want``).
Each gateway gets the worker's whole load in its heartbeats, and each request's outputs go back to
the gateway that sent it.

Any message from a gateway counts as its heartbeat; when one has been silent for ``liveness``
intervals the worker aborts that gateway's requests (it has moved them already) and reconnects to
it with backoff from 1 s to 32 s, while it goes on serving the others. So workers survive gateway
restarts, and a dead gateway costs only its own requests.

SIGTERM (or SIGINT) drains: the worker tells every gateway at once (``draining`` in its heartbeat),
finishes what it holds, then says Goodbye and exits. A second signal, or ``drain_timeout``, ends the
drain early; the gateways then move the requests that were left to other workers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections import deque

import zmq

from common.model_source import TokenizerBundle
from common.protocol import Ready, RequestOutput, StepOutputs
from worker.gateways import Gateways
from worker.handshake import GatewayLink
from worker.heartbeat import Vitals
from worker.inbound import Inbound
from worker.lora.registry import lora_info
from worker.stepper import Stepped, Stepper, StepThread
from worker.threads import AdaptiveTeam

log = logging.getLogger(__name__)


class WorkerProc:
    """Connects to every gateway, registers, and runs the engine loop until told to stop."""

    def __init__(
        self,
        engine: Stepped,
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
        stepper: Stepper | None = None,
        team: AdaptiveTeam | None = None,
    ) -> None:
        """``stepper``: the thread the engine was built on (see StepThread); a new one otherwise.
        ``team``: told each step's time, it sizes the step's thread team (worker/threads.py)."""
        self.team = team
        self.engine = engine
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
            pooling=getattr(getattr(engine, "pooling", None), "info", None),  # a pooling model's abilities
            lora=lora_info(getattr(engine, "loras", None)),
        )
        self.gateways = Gateways(address, self.name, self.ready, curve_keys, heartbeat_interval, heartbeat_liveness)
        self.stopping = False
        self.drain_timeout = drain_timeout
        self.draining_since: float | None = None
        self.inbound = Inbound(engine, self.name, self.ready, tokenizer)  # what arrives, and who owns what
        self.owner = self.inbound.owner  # request id -> the gateway that sent it
        self.vitals = Vitals()
        self._stepper = stepper or StepThread()
        self._outbox: deque[StepOutputs] = deque()  # outputs of the steps that ended, to send

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.drain())

    def drain(self) -> None:
        """First call: finish the current requests, take no new ones, then leave. Second: leave now."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()  # a step may be running: read no engine state here
            self.vitals.draining = True
            log.info("draining: finishing %d requests, taking no new ones", len(self.owner))
        else:
            self.stopping = True

    # ---- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        """Serve every gateway until stopped; reconnect each one that goes silent, with backoff."""
        self.open()
        try:
            events: dict = {}
            poller, polled = zmq.Poller(), []
            while not self.stopping:
                wait_s = self.turn(events)
                if self.stopping:
                    break
                if (watched := self.watched()) != polled:  # a poller per change of links, not per turn (per token)
                    poller, polled = zmq.Poller(), watched
                    for item in watched:
                        poller.register(item, zmq.POLLIN)
                events = dict(poller.poll(int(wait_s * 1000)))
        finally:
            self.close()

    def open(self) -> None:
        """Start finding the gateways and stepping the engine (``run`` does; a host of many loops too)."""
        self.gateways.resolve_in_background(lambda: self.stopping)
        self._stepper.start(self._step, self.engine.has_work)

    def close(self) -> None:
        """Stop stepping, send what is left, say goodbye to every gateway."""
        self._stepper.stop()
        self._send_outputs()
        self.gateways.goodbye()
        dropped = self.engine.fail_all("worker stopped")
        if dropped:
            log.warning("stopped with %d requests unfinished", len(dropped))

    def watched(self) -> list:
        """What the loop waits on: the stepping thread's step ends, and every connected link."""
        return [self._stepper, *(item for link in self.gateways.connected() for item in (link.sock, link.monitor))]

    def turn(self, events: dict) -> float:
        """One turn: read the messages that the last wait found in ``events`` (answering what needs
        no engine); (re)connect links; send the outputs of the steps that ended; when there is
        something for the engine (requests, aborts, a heartbeat due, a silent gateway, a drain),
        take it between two steps, or ask for it at the running step's end. Returns how long to wait
        next, at most, for messages, a step's end or a timer (``watched`` says on what)."""
        for link in list(self.gateways.links.values()):
            if link.stirred(events):
                link.read_monitor()
                if self.inbound.read(link) and not link.heard:  # the gateway only talks to workers it registered
                    log.info("registered with the gateway at %s as %s", link.address, self.name)
                    link.heard = True
        now = time.monotonic()
        self.gateways.update(now, accepting=self.draining_since is None)
        self._stepper.clear()
        self._send_outputs()
        if (self._stepper.wanted or self._needs_engine(now)) and self._stepper.want():
            try:
                self._tend_engine()
            finally:
                self._stepper.release()
            if self.stopping:
                return 0.0
        elif self.gateways.heartbeat_due(now):  # a step runs (it may be long): say we are alive meanwhile
            self.gateways.send_heartbeats(now, self.vitals.during_step(self.inbound.arrived()))
        now = time.monotonic()
        wait_s = self.gateways.interval
        for link in self.gateways.links.values():
            if link.sock is None:
                wait_s = min(wait_s, max(0.0, link.retry_at - now))
                continue
            link.flush()
            wait_s = min(wait_s, max(0.0, link.next_heartbeat - now))
            if link.unsent:
                wait_s = min(wait_s, 0.01)
        return wait_s

    def _needs_engine(self, now: float) -> bool:
        return self.inbound.waiting() or self.draining_since is not None or self.gateways.due_or_silent(now)

    def _tend_engine(self) -> None:
        """The engine is ours between two steps: hand it what arrived, end a drain that is done,
        drop silent gateways' requests, and send the heartbeats that are due."""
        self._send_outputs()  # every step that ended: before any abort's outputs or heartbeat
        self.inbound.apply()
        now = time.monotonic()
        if self.draining_since is not None and (
            not self.engine.has_work() or now - self.draining_since > self.drain_timeout
        ):
            self.stopping = True
            return
        self._judge_silences(now)
        self.gateways.send_heartbeats(now, self.vitals.held(self.engine.load()))

    def _judge_silences(self, now: float) -> None:
        """Engine held: drop every gateway silent for too long (its requests are aborted)."""
        for link in list(self.gateways.links.values()):
            if self.gateways.silent(now, link):
                self.inbound.read(link)  # read what is waiting before judging
                now = time.monotonic()
                if self.gateways.silent(now, link):
                    log.warning("no word from the gateway at %s for %.1f s", link.address, now - link.last_heard)
                    self._disconnect(link, now)

    def _step(self) -> None:
        """On the engine thread: one step, its outputs posted for the socket loop to send."""
        start = time.perf_counter()
        try:
            step = self.engine.step()
        except Exception as exc:  # a failed step must not kill the worker or leak blocks
            log.exception("step failed")
            step = StepOutputs(self.engine.fail_all(f"step failed: {type(exc).__name__}: {exc}"))
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.new_token_ids) for o in step.outputs)
        if tokens:
            self.vitals.capacity.add(tokens, elapsed)
        if self.team is not None:
            self.team.observe(elapsed, step.num_tokens)
        if (events := getattr(getattr(self.engine, "blocks", None), "events", None)) is not None:
            events.flush()  # this step's KV events, one batch (worker/kv_events.py)
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
            self.gateways.links[address].send(StepOutputs(outputs, step.batch_size, step.num_tokens))

    def _disconnect(self, link: GatewayLink, now: float) -> None:
        """The gateway went silent: drop its requests (it moved them already) and close its link."""
        dropped = [request_id for request_id in link.requests if self.owner.get(request_id) is link]
        for request_id in dropped:
            self.owner.pop(request_id, None)
        link.requests.clear()
        if dropped:
            self.engine.abort(dropped)
            log.warning("gateway %s silent: dropped its %d requests", link.address, len(dropped))
        self.gateways.close(link, now)
