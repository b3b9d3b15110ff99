"""Workers with no model, for measuring the gateway alone: the real worker process loop (worker/proc.py)
around engines that answer every running request with one token per step, at once or every
``--step-ms`` milliseconds.

``--count M`` hosts M such workers in this one process (1,024 worker processes don't fit on a small
machine): each is a WorkerProc of its own (its name, engine and one DEALER per gateway of
``--gateway-address``, comma-separated), and one thread runs all their loops' turns over one poller
(``Fleet``), stepping their engines too. So each registers (``Ready``, with its tokenizer's digest),
heartbeats with its load, answers ``DescribeModel`` with the default model's tokenizer files
(``ModelInfo``), runs requests, drains on SIGTERM and re-registers when a gateway goes silent,
exactly as a real worker does: the code is the real worker's, only the waiting is shared.

    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555 [--step-ms 0]
    python -m bench.fake_worker --gateway-address tcp://127.0.0.1:5555,tcp://127.0.0.1:5556 --count 256
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import msgspec
import zmq

from common.logs import setup_logging
from common.model_source import DEFAULT_MODEL, TokenizerBundle
from common.protocol import Heartbeat, ModelInfo, NewRequest, RequestOutput, StepOutputs
from worker.proc import WorkerProc

log = logging.getLogger(__name__)

WORDS = list(range(1000, 1100))  # ordinary word pieces of the default tokenizer


class FakeEngine:
    """The engine a WorkerProc steps (its ``Stepped`` protocol), without a model."""

    max_model_len = 8192
    max_num_seqs = 4096
    blocks = SimpleNamespace(capacity_tokens=10**7, block_size=16)

    def __init__(self, step_s: float, token_s: float = 0.0, sleeps: bool = True) -> None:
        self.step_s = step_s
        self.token_s = token_s  # and this much more per running request: a speed that does not grow with the batch
        self.sleeps = sleeps  # a step takes its time here (False: whoever steps it waits it out)
        self.running: dict[str, list[int]] = {}  # id -> [prompt tokens, tokens left, produced]
        self.refused: list[RequestOutput] = []  # requests that did not decode, answered at the next step
        self.steps = 0

    def add_request(self, new: NewRequest) -> None:
        self.running[new.request_id] = [
            len(new.prompt_token_ids),
            new.max_new_tokens,
            0,
        ]

    def reject(self, request_id: str, error: str, num_prompt_tokens: int = 0, bad_request: bool = False) -> None:
        self.refused.append(
            RequestOutput(request_id, [], "error", num_prompt_tokens, error=error, bad_request=bad_request)
        )

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        return [RequestOutput(i, [], "abort") for i in request_ids if self.running.pop(i, None)]

    def has_work(self) -> bool:
        return bool(self.running or self.refused)

    def step_time(self) -> float:
        return self.step_s + self.token_s * len(self.running)

    def step(self) -> StepOutputs:
        if self.sleeps and (self.step_s or self.token_s):
            time.sleep(self.step_time())
        self.steps += 1
        outputs, self.refused = self.refused, []
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


def fake_worker(
    name: str, args: argparse.Namespace, addresses: list[str], info: ModelInfo | None, fleet: bool = False
) -> WorkerProc:
    """One model-less worker: the real socket loop (worker/proc.py) around a FakeEngine; in a
    ``fleet``, stepped inline by the fleet's thread instead of a stepping thread of its own."""
    engine = FakeEngine(args.step_ms / 1000, args.token_ms / 1000, sleeps=not fleet)
    return WorkerProc(
        engine,
        ",".join(addresses),
        name,
        args.model,
        "none",
        "none",
        args.heartbeat_interval,
        args.heartbeat_liveness,
        tokenizer=TokenizerBundle(info.files, info.chat_template or "", info.tokenizer_digest) if info else None,
        stepper=InlineStepper(engine) if fleet else None,
    )


class InlineStepper:
    """Steps a FakeEngine on the fleet's thread, ``step_time`` apart while it has work: the engine is
    the socket loop's whenever the loop asks (nothing steps meanwhile)."""

    wanted = False

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.next_step: float | None = None  # None while idle

    def due(self, now: float) -> bool:
        """Whether a step is due now (a worker that just got work steps ``step_time`` later)."""
        if not self.engine.has_work():
            self.next_step = None
        elif self.next_step is None:
            self.next_step = now + self.engine.step_time()
        return self.next_step is not None and now >= self.next_step

    def start(self, step: Callable[[], None], has_work: Callable[[], bool]) -> None:
        self.step = step  # WorkerProc's: the engine's step, its outputs posted for the loop to send

    def step_now(self, now: float) -> None:
        self.step()
        self.next_step = now + self.engine.step_time()

    def fileno(self) -> int:
        raise NotImplementedError("the fleet waits on the sockets alone")

    def clear(self) -> None:
        pass

    def want(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def stop(self) -> None:
        pass


class Fleet:
    """Many workers' socket loops (WorkerProc's own ``turn``) on one thread, sharing one poller: a
    worker's turn runs when one of its sockets stirs, when its own wait is over, or after its
    engine stepped. One thread for all because a thread per worker (a loop and a stepping thread
    each) took the two cores from the gateway being measured: 24 requests/s through it at 1,024
    workers, and departures, where one shared loop gives ten times that and none."""

    def __init__(self, procs: list[WorkerProc]) -> None:
        self.procs = procs
        self.poller = zmq.Poller()
        self.owner: dict[zmq.Socket, WorkerProc] = {}
        self.registered: dict[WorkerProc, list[zmq.Socket]] = {}
        self.due: dict[WorkerProc, float] = {}  # when each one's turn comes at the latest
        self.timers: list[tuple[float, int, WorkerProc]] = []  # the same, as a heap (stale entries skipped)
        self.busy: set[WorkerProc] = set()  # engines with work: they step
        self._order = itertools.count()

    def drain(self) -> None:
        for proc in self.procs:
            proc.drain()
            self._at(proc, 0.0)

    def run(self, interval: float) -> None:
        """Run every worker until all have stopped (SIGTERM or SIGINT drains them); their first
        turns (registrations) spread over one heartbeat interval, as independent workers' would."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.drain())
        start = time.monotonic()
        for i, proc in enumerate(self.procs):
            proc.open()
            self._at(proc, start + interval * i / len(self.procs))
        while self.due:
            now = time.monotonic()
            steps = [t for proc in self.busy if (t := proc._stepper.next_step) is not None]  # type: ignore[attr-defined]
            wake = min([self.timers[0][0] if self.timers else now + interval, *steps])
            events = dict(self.poller.poll(max(0, int((wake - now) * 1000))))
            now = time.monotonic()
            ready = {self.owner[sock] for sock in events if sock in self.owner}
            for proc in list(self.busy):
                stepper: InlineStepper = proc._stepper  # type: ignore[assignment]
                if stepper.due(now):
                    stepper.step_now(now)
                    ready.add(proc)
                elif stepper.next_step is None:
                    self.busy.discard(proc)
            while self.timers and self.timers[0][0] <= now:
                at, _, proc = heapq.heappop(self.timers)
                if self.due.get(proc) == at:
                    ready.add(proc)
            for proc in ready:
                self._turn(proc, events)

    def _at(self, proc: WorkerProc, when: float) -> None:
        self.due[proc] = when
        heapq.heappush(self.timers, (when, next(self._order), proc))

    def _turn(self, proc: WorkerProc, events: dict) -> None:
        wait_s = proc.turn(events)
        if proc.stopping:
            proc.close()
            del self.due[proc]
            self.busy.discard(proc)
            self._watch(proc, [])
            return
        self._at(proc, time.monotonic() + wait_s)
        if proc.engine.has_work():
            self.busy.add(proc)
        self._watch(proc, proc.watched()[1:])  # its sockets (the first is its stepper)

    def _watch(self, proc: WorkerProc, sockets: list[zmq.Socket]) -> None:
        old = self.registered.get(proc, [])
        if old == sockets:
            return
        for sock in old:
            self.poller.unregister(sock)
            del self.owner[sock]
        for sock in sockets:
            self.poller.register(sock, zmq.POLLIN)
            self.owner[sock] = proc
        self.registered[proc] = sockets


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fake_worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--gateway-address", default="tcp://127.0.0.1:5555", help="comma-separated: every worker connects to each"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the name to register under")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--token-ms", type=float, default=0.0, help="step time grows by this per running request")
    parser.add_argument(
        "--count",
        type=int,
        default=1,
        help="simulated workers in this process (their loops share one thread and one poller)",
    )
    parser.add_argument(
        "--name", "--worker-name", default="fake-worker", help="worker name (a fleet's are NAME-0, NAME-1, ...)"
    )
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--heartbeat-liveness", type=int, default=5)
    parser.add_argument("--model-info", help="fleet: a file caching the tokenizer's ModelInfo (built on first use)")
    parser.add_argument("--no-model-info", action="store_true", help="fleet: don't build or send the tokenizer's files")
    args = parser.parse_args()
    setup_logging("fake-worker")
    addresses = [a.strip() for a in args.gateway_address.split(",") if a.strip()]
    info = None if args.no_model_info else load_model_info(args.model_info, args.model)
    if args.count == 1:
        proc = fake_worker(args.name, args, addresses, info)
        proc.install_signal_handlers()
        proc.run()
        return
    # Three sockets per gateway link (the DEALER and its handshake monitor's pair), all in one context.
    zmq.Context.instance().set(zmq.MAX_SOCKETS, 3 * args.count * len(addresses) + 64)
    log.info("%d simulated workers connecting to %s", args.count, ", ".join(addresses))
    Fleet([fake_worker(f"{args.name}-{i}", args, addresses, info, fleet=True) for i in range(args.count)]).run(
        args.heartbeat_interval
    )


if __name__ == "__main__":
    main()
