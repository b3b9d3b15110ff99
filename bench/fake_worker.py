"""Workers with no model, for measuring the gateway alone: engines that answer every running request
with one token per step, at once or every ``--step-ms`` milliseconds.

One worker (the default) runs the real DEALER loop (worker.proc) around one such engine. ``--count M``
hosts M simulated workers in this one process instead (1,024 worker processes don't fit on a small
machine): each has its own name, engine and one DEALER socket per gateway of ``--gateway-address``
(comma-separated), and one ``zmq.Poller`` loop serves them all. Each registers (``Ready``, with its
tokenizer's digest), heartbeats every ``--heartbeat-interval`` with its load, answers ``DescribeModel``
with the default model's tokenizer files (``ModelInfo``), runs requests and re-registers when a
gateway goes silent, as a real worker does.

    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555 [--step-ms 0]
    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 --count 256
"""

from __future__ import annotations

import argparse
import heapq
import logging
import random
import signal
import time
import uuid
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import msgspec
import zmq

from common import protocol
from common.logs import setup_logging
from common.model_source import DEFAULT_MODEL
from common.protocol import (
    Abort,
    AddRequests,
    DescribeModel,
    Goodbye,
    Heartbeat,
    ModelInfo,
    NewRequest,
    Ready,
    RequestOutput,
    StepOutputs,
)

log = logging.getLogger(__name__)

WORDS = list(range(1000, 1100))  # ordinary word pieces of the default tokenizer


class FakeEngine:
    """The Engine interface (add_request, abort, has_work, step, fail_all, load) without a model."""

    max_model_len = 8192
    max_num_seqs = 4096
    blocks = SimpleNamespace(capacity_tokens=10**7, block_size=16)

    def __init__(self, step_s: float, token_s: float = 0.0) -> None:
        self.step_s = step_s
        self.token_s = token_s  # and this much more per running request: a speed that does not grow with the batch
        self.running: dict[str, list[int]] = {}  # id -> [prompt tokens, tokens left, produced]
        self.steps = 0

    def add_request(self, new: NewRequest) -> None:
        self.running[new.request_id] = [
            len(new.prompt_token_ids),
            new.max_new_tokens,
            0,
        ]

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return [RequestOutput(i, [], "abort") for i in request_ids if self.running.pop(i, None)]

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self, sleep: bool = True) -> StepOutputs:
        if (self.step_s or self.token_s) and sleep:
            time.sleep(self.step_s + self.token_s * len(self.running))
        self.steps += 1
        outputs = []
        for request_id, state in list(self.running.items()):
            state[1] -= 1
            state[2] += 1
            done = state[1] == 0
            outputs.append(
                RequestOutput(
                    request_id,
                    [WORDS[state[2] % len(WORDS)]],
                    "length" if done else None,
                    state[0],
                    state[2],
                    seq=state[2] - 1,  # one output per step: the gateway checks they arrive without a gap
                )
            )
            if done:
                del self.running[request_id]
        return StepOutputs(outputs, batch_size=len(outputs), num_tokens=len(outputs))

    def fail_all(self, message: str) -> list[RequestOutput]:
        failed = [RequestOutput(i, [], "error", error=message) for i in self.running]
        self.running.clear()
        return failed

    def load(self) -> Heartbeat:
        capacity = self.blocks.capacity_tokens // self.blocks.block_size
        return Heartbeat(running=len(self.running), steps=self.steps, free_blocks=capacity, total_blocks=capacity)


def build_model_info(model: str = DEFAULT_MODEL) -> ModelInfo:
    """The model's tokenizer as a worker describes it (common.model_source's bundle). Loads the real
    tokenizer (seconds): build once."""
    from common.config import CACHE_DIR
    from common.model_source import bundle_tokenizer, load_tokenizer, read_chat_template, resolve_model

    tokenizer = load_tokenizer(resolve_model(model), CACHE_DIR.env_default())
    bundle = bundle_tokenizer(tokenizer, read_chat_template(None, getattr(tokenizer, "chat_template", None)))
    return ModelInfo(model, bundle.digest, bundle.packed, bundle.chat_template)


def load_model_info(path: str | None, model: str) -> ModelInfo:
    """A ModelInfo saved by ``save_model_info`` (so a fleet of processes builds it once), or a fresh one."""
    if path and Path(path).is_file():
        return msgspec.msgpack.decode(Path(path).read_bytes(), type=ModelInfo)
    info = build_model_info(model)
    if path:
        Path(path).write_bytes(msgspec.msgpack.encode(info))
    return info


class Link:
    """One simulated worker's connection to one gateway: a DEALER with its own identity."""

    __slots__ = ("address", "sock", "last_heard", "unsent", "worker", "registered")

    def __init__(self, worker: SimWorker, address: str) -> None:
        self.worker = worker
        self.address = address
        self.sock: zmq.Socket | None = None
        self.last_heard = 0.0
        self.unsent: deque[list[bytes]] = deque()
        self.registered = False


class SimWorker:
    """One simulated worker: an engine, and where each of its requests came from."""

    __slots__ = ("name", "engine", "links", "origin", "next_step")

    def __init__(self, name: str, step_s: float, addresses: list[str]) -> None:
        self.name = name
        self.engine = FakeEngine(step_s)
        self.links = [Link(self, address) for address in addresses]
        self.origin: dict[str, Link] = {}  # request id -> the gateway link it came from
        self.next_step = 0.0


class Fleet:
    """M simulated workers in one process, every socket in one poller."""

    def __init__(
        self,
        addresses: list[str],
        count: int,
        prefix: str,
        model: str,
        step_s: float,
        interval: float,
        liveness: int,
        info: ModelInfo | None,
    ) -> None:
        self.context = zmq.Context(io_threads=1)
        self.context.set(zmq.MAX_SOCKETS, max(1024, 2 * count * len(addresses) + 64))
        self.step_s, self.interval, self.liveness, self.info = step_s, interval, liveness, info
        self.workers = [SimWorker(f"{prefix}-{i}", step_s, addresses) for i in range(count)]
        self.ready = {
            w.name: Ready(
                w.name,
                model,
                FakeEngine.max_model_len,
                10**7,
                16,
                FakeEngine.max_num_seqs,
                "none",
                "none",
                tokenizer_digest=info.tokenizer_digest if info else "",
            )
            for w in self.workers
        }
        self.poller = zmq.Poller()
        self.by_socket: dict[zmq.Socket, Link] = {}
        self.busy: set[SimWorker] = set()
        self.backlogged: set[Link] = set()  # links holding messages their socket did not take yet
        self.heartbeats: list[tuple[float, int, SimWorker]] = []  # (due, tiebreak, worker): a heap
        self.stopping = False
        self.sent = {"heartbeats": 0, "step_outputs": 0, "model_info": 0, "reconnects": 0}

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))

    def _connect(self, link: Link) -> None:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"{link.worker.name}/{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(link.address)
        link.sock, link.last_heard, link.registered = sock, time.monotonic(), False
        link.unsent.clear()
        self.backlogged.discard(link)
        self.by_socket[sock] = link
        self.poller.register(sock, zmq.POLLIN)
        self._send(link, self.ready[link.worker.name])

    def _disconnect(self, link: Link, goodbye: bool = False) -> None:
        if link.sock is None:
            return
        if goodbye:
            self._send(link, Goodbye("shutting down"))
        self.poller.unregister(link.sock)
        del self.by_socket[link.sock]
        link.sock.close(linger=500 if goodbye else 0)
        link.sock = None

    def run(self) -> None:
        now = time.monotonic()
        for i, worker in enumerate(self.workers):
            for link in worker.links:
                self._connect(link)
            # Spread heartbeats over the interval, as independent workers' would be.
            heapq.heappush(self.heartbeats, (now + random.random() * self.interval, i, worker))
        next_liveness_check = now + self.interval
        while not self.stopping:
            now = time.monotonic()
            wait = self.heartbeats[0][0] - now if self.heartbeats else self.interval
            if self.busy:
                wait = min(wait, min(w.next_step for w in self.busy) - now)
            for sock, _ in self.poller.poll(max(0, int(wait * 1000))):
                self._drain(self.by_socket[sock])
            now = time.monotonic()
            self._step_due(now)
            while self.heartbeats and self.heartbeats[0][0] <= now:
                _, i, worker = heapq.heappop(self.heartbeats)
                load = worker.engine.load()
                for link in worker.links:
                    self._send(link, load)
                self.sent["heartbeats"] += len(worker.links)
                heapq.heappush(self.heartbeats, (now + self.interval, i, worker))
            if now >= next_liveness_check:
                next_liveness_check = now + self.interval
                self._check_liveness(now)
            for link in list(self.backlogged):
                self._flush(link)
        for worker in self.workers:
            for link in worker.links:
                self._disconnect(link, goodbye=True)
        self.context.term()

    def _step_due(self, now: float) -> None:
        for worker in [w for w in self.busy if w.next_step <= now]:
            step = worker.engine.step(sleep=False)
            worker.next_step = now + self.step_s
            per_link: dict[Link, list[RequestOutput]] = {}
            for output in step.outputs:
                link = worker.origin.get(output.request_id)
                if output.finish_reason is not None:
                    worker.origin.pop(output.request_id, None)
                if link is not None:
                    per_link.setdefault(link, []).append(output)
            for link, outputs in per_link.items():
                self._send(link, StepOutputs(outputs, batch_size=step.batch_size, num_tokens=step.num_tokens))
                self.sent["step_outputs"] += 1
            if not worker.engine.has_work():
                self.busy.discard(worker)

    def _drain(self, link: Link) -> None:
        """Every message waiting on this link's socket."""
        worker = link.worker
        while link.sock is not None:
            try:
                frames = link.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(frames)
            except protocol.ProtocolError as exc:
                log.warning("%s dropped a malformed message: %s", worker.name, exc)
                continue
            link.last_heard, link.registered = time.monotonic(), True
            if isinstance(msg, AddRequests):
                for new in msg.requests:
                    worker.engine.add_request(new)
                    worker.origin[new.request_id] = link
                if msg.requests and worker not in self.busy:
                    worker.next_step = time.monotonic() + self.step_s
                    self.busy.add(worker)
            elif isinstance(msg, Abort):
                for request_id in msg.request_ids:
                    worker.origin.pop(request_id, None)
                self._send(link, StepOutputs(worker.engine.abort(msg.request_ids)))
            elif isinstance(msg, DescribeModel):
                if self.info is not None:
                    self._send(link, self.info)
                    self.sent["model_info"] += 1
            elif not isinstance(msg, Heartbeat):
                log.warning("%s: unexpected %s from the gateway", worker.name, type(msg).__name__)

    def _check_liveness(self, now: float) -> None:
        """A gateway silent for ``liveness`` intervals dropped us (or restarted): register again under a
        new identity, dropping the requests that came from it (the gateway resumed them elsewhere)."""
        for worker in self.workers:
            for link in worker.links:
                if now - link.last_heard > self.interval * self.liveness:
                    lost = [i for i, origin in worker.origin.items() if origin is link]
                    for request_id in lost:
                        del worker.origin[request_id]
                    worker.engine.abort(lost)
                    self._disconnect(link)
                    self._connect(link)
                    self.sent["reconnects"] += 1

    def _send(self, link: Link, msg: protocol.Message) -> None:
        """Never block the loop; what a socket can't take now waits (in order) for the next try."""
        frames = protocol.encode(msg)
        if not link.unsent and link.sock is not None:
            try:
                link.sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        link.unsent.append(frames)
        self.backlogged.add(link)

    def _flush(self, link: Link) -> None:
        while link.unsent and link.sock is not None:
            try:
                link.sock.send_multipart(link.unsent[0], zmq.NOBLOCK)
            except zmq.Again:
                return
            link.unsent.popleft()
        self.backlogged.discard(link)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gateway-address", default="tcp://127.0.0.1:5555", help="comma-separated: every worker connects to each")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the name to register under")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--token-ms", type=float, default=0.0, help="single worker: step time grows by this per running request")
    parser.add_argument("--count", type=int, default=1, help="simulated workers in this process (more than 1: the fleet loop)")
    parser.add_argument("--name", default="fake-worker", help="worker name (a fleet's are NAME-0, NAME-1, ...)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-liveness", type=int, default=5)
    parser.add_argument("--model-info", help="fleet: a file caching the tokenizer's ModelInfo (built on first use)")
    parser.add_argument("--no-model-info", action="store_true", help="fleet: don't build or send the tokenizer's files")
    args = parser.parse_args()
    setup_logging("fake-worker")
    addresses = [a.strip() for a in args.gateway_address.split(",") if a.strip()]
    info = None if args.no_model_info else load_model_info(args.model_info, args.model)
    if args.count == 1:
        from common.model_source import TokenizerBundle
        from worker.proc import WorkerProc

        proc = WorkerProc(
            FakeEngine(args.step_ms / 1000, args.token_ms / 1000),
            ",".join(addresses),
            args.name,
            args.model,
            "none",
            "none",
            args.heartbeat_interval,
            args.heartbeat_liveness,
            tokenizer=TokenizerBundle(info.files, info.chat_template or "", info.tokenizer_digest) if info else None,
        )
        proc.install_signal_handlers()
        proc.run()
        return
    fleet = Fleet(addresses, args.count, args.name, args.model, args.step_ms / 1000, args.heartbeat_interval, args.heartbeat_liveness, info)
    fleet.install_signal_handlers()
    log.info("%d simulated workers connecting to %s", args.count, ", ".join(addresses))
    fleet.run()
    log.info("stopped: sent %s", fleet.sent)


if __name__ == "__main__":
    main()
