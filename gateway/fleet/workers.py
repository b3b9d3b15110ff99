"""The gateway's records of the pool: what it knows of each worker and each model, of each request
in flight (enough to resume it elsewhere), which worker a prompt prefix was last sent to, and which
workers could not start."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from common.protocol import Heartbeat, NewRequest, Ready, RequestOutput, WorkerEvent
from gateway.errors import GenerationFailed

log = logging.getLogger(__name__)

Narrow = Callable[[list["WorkerInfo"]], list["WorkerInfo"]]  # which of the available workers a request may go to

# A worker's KV store figures (common/protocol.py Heartbeat), shown as they come in /workers.
KV_STORE_FIELDS = (
    "kv_store_id",
    "kv_store_hits",
    "kv_store_misses",
    "kv_store_read_bytes",
    "kv_store_written_bytes",
    "kv_store_read_seconds",
    "kv_store_size_bytes",
    "kv_store_evictions",
)


@dataclass(slots=True)
class WorkerInfo:
    """What the gateway knows of one registered worker."""

    identity: bytes
    ready: Ready
    expiry: float
    load: Heartbeat = field(default_factory=Heartbeat)
    heartbeats: int = 0  # load reports received; lets a reader tell fresh figures from stale ones
    last_progress: float = field(default_factory=time.monotonic)  # last step output, or last time it had no work
    inflight: set[str] = field(default_factory=set)
    pending: list[NewRequest] = field(default_factory=list)
    outstanding_tokens: int = 0  # prompt + remaining budget of its in-flight requests: the routing load
    requests_assigned: int = 0
    steps_seen: int = 0
    batched_steps: int = 0  # steps that ran more than one sequence, as the worker reported them
    peak_batch_size: int = 0

    def release(self, stream: RequestStream) -> None:
        """The request is no longer this worker's (it ended, or moves on)."""
        if stream.request_id in self.inflight:
            self.inflight.discard(stream.request_id)
            self.outstanding_tokens -= stream.cost

    def stalled(self, now: float, limit: float) -> bool:
        """Holding requests by its own account (its latest heartbeat) and producing nothing for
        ``limit`` s. Requests it never accepted don't count: they are not its to work on."""
        holds = self.inflight and (self.load.running or self.load.waiting)
        return bool(holds) and now - self.last_progress > limit

    def snapshot(self, pinned: int = 0) -> dict:
        return {
            "name": self.ready.worker_name,
            "identity": self.identity.decode(errors="replace"),
            "model": self.ready.model,
            "device": self.ready.device,
            "dtype": self.ready.dtype,
            "max_model_len": self.ready.max_model_len,
            "kv_capacity_tokens": self.ready.kv_capacity_tokens,
            "inflight": len(self.inflight),
            "outstanding_tokens": self.outstanding_tokens,
            "requests_assigned": self.requests_assigned,
            "pinned_sockets": pinned,  # Responses WebSockets whose turns stay on this worker
            "running": self.load.running,
            "waiting": self.load.waiting,
            "free_blocks": self.load.free_blocks,
            "total_blocks": self.load.total_blocks,
            "tokens_per_s": self.load.tokens_per_s,
            "steps": self.load.steps,
            "heartbeats": self.heartbeats,
            "preemptions": self.load.preemptions,
            "prefix_hit_tokens": self.load.prefix_hit_tokens,
            "prefix_queried_tokens": self.load.prefix_queried_tokens,
            "cached_blocks": self.load.cached_blocks,
            "steps_seen": self.steps_seen,
            "batched_steps": self.batched_steps,
            "peak_batch_size": max(self.peak_batch_size, self.load.peak_batch_size),
            "draining": self.load.draining,
            "capacity_tokens_per_s": self.load.capacity_tokens_per_s,
            "spec_proposed_tokens": self.load.spec_proposed_tokens,
            "spec_accepted_tokens": self.load.spec_accepted_tokens,
            **{name: getattr(self.load, name) for name in KV_STORE_FIELDS},
            "lora": None if self.load.lora is None else msgspec.structs.asdict(self.load.lora),  # gateway/fleet/lora.py
            "lora_adapters": None if self.ready.lora is None else sorted(self.ready.lora.adapters),
        }


class ModelPool:
    """The workers of one model, and how the gateway picks among them.

    A request goes to the worker that would finish it first: the least outstanding work (prompt plus
    remaining budget of what it holds, plus this request) relative to the worker's measured speed
    (``capacity_tokens_per_s`` from its heartbeats), so a worker twice as fast gets about twice the
    work. A worker that has not measured itself yet counts at the pool's median speed. In a large
    pool only SCAN_LIMIT workers picked at random are compared (the power of d choices: nearly as
    even as a full scan, at a cost that does not grow with the pool).
    """

    SCAN_LIMIT = 16
    NEAR_TIE = 1.25

    def __init__(self, name: str) -> None:
        self.name = name
        self.digest: str | None = None  # its tokenizer's, once the gateway holds it (None while it is being learned)
        self.workers: dict[bytes, WorkerInfo] = {}
        self._available: list[WorkerInfo] | None = None  # cached; None after any change
        self._limits: tuple[int, int] | None = None  # (max_model_len, kv capacity) every worker takes; cached likewise
        self._median_speed = 1.0
        self._median_at = -1e9
        self.describing: tuple[bytes, float] | None = None  # the joining worker asked for the tokenizer, and when
        self.learning = False  # its tokenizer is being loaded now

    def changed(self) -> None:
        """A worker joined, left, or began draining: the available list is rebuilt on next use."""
        self._available = None
        self._limits = None

    def available(self, now: float) -> list[WorkerInfo]:
        """Workers of this model that take new requests (registered and not draining)."""
        if self._available is None:
            self._available = [w for w in self.workers.values() if not w.load.draining]
        if (
            self._available is not None and now - self._median_at > 1.0
        ):  # speeds move with heartbeats: once a second is enough
            speeds = sorted(w.load.capacity_tokens_per_s for w in self._available if w.load.capacity_tokens_per_s > 0)
            self._median_speed, self._median_at = (speeds[len(speeds) // 2] if speeds else 1.0), now
        return self._available

    def limits(self) -> tuple[int, int]:
        """(max_model_len, kv capacity) that every worker of this model can take. Asked on every
        request: computed once per change of the pool, not once per request (a scan of every worker)."""
        if self._limits is None:
            infos = self.workers.values()
            self._limits = min(w.ready.max_model_len for w in infos), min(w.ready.kv_capacity_tokens for w in infos)
        return self._limits

    def taking(self, identity: bytes) -> WorkerInfo | None:
        """The worker with this identity if it is in this pool and takes new requests."""
        worker = self.workers.get(identity)
        return worker if worker is not None and not worker.load.draining else None

    def choose(self, cost: int, now: float, narrow: Narrow | None = None) -> WorkerInfo:
        """The worker expected to finish ``cost`` more tokens of work soonest, of those ``narrow``
        keeps (an adapter's request: those gateway/fleet/lora.py's ``prefer`` keeps)."""
        available = self.available(now) if narrow is None else narrow(self.available(now))
        candidates = available
        if (
            len(available) > self.SCAN_LIMIT
        ):  # a window at a random place: O(SCAN_LIMIT), unlike random.sample's bookkeeping
            start = random.randrange(len(available))
            candidates = available[start : start + self.SCAN_LIMIT]
            candidates += available[: self.SCAN_LIMIT - len(candidates)]
        median = self._median_speed
        scored = [((w.outstanding_tokens + cost) / (w.load.capacity_tokens_per_s or median), w) for w in candidates]
        # Idle workers tie among themselves (at their best score): a speed figure is throughput at
        # the batch a worker ran lately (one that ran 32 streams reports 6x one that ran a single
        # stream), not how fast it serves one request.
        idle = [score for score, w in scored if not w.inflight]
        if idle:
            scored = [(score if w.inflight else min(idle), w) for score, w in scored]
        best = min(score for score, _ in scored)
        # Speeds are measurements: two like workers differ by noise, and the one measured a little
        # faster would take every request at low load (and the other's figure would never refresh).
        # Within NEAR_TIE of the best, the one holding the fewest requests gets it.
        tied = [w for score, w in scored if score <= best * self.NEAR_TIE]
        return min(tied, key=lambda w: (len(w.inflight), w.requests_assigned))


class Trace(Protocol):
    """What dispatch tells a request's trace (gateway/ops/tracing.py's ``GenerationTrace``)."""

    def assigned(self, worker_name: str) -> None: ...
    def resumed(self, reason: str, attempt: int, delivered_tokens: int) -> None: ...
    def worker_events(self, events: list[WorkerEvent], worker_name: str) -> None: ...
    def output(self, item: RequestOutput | Exception) -> None: ...
    def end(self, outcome: str) -> None: ...


class Untraced:
    """The trace of a request while tracing is off: every hook does nothing."""

    def assigned(self, worker_name: str) -> None:
        pass

    def resumed(self, reason: str, attempt: int, delivered_tokens: int) -> None:
        pass

    def worker_events(self, events: list[WorkerEvent], worker_name: str) -> None:
        pass

    def output(self, item: RequestOutput | Exception) -> None:
        pass

    def end(self, outcome: str) -> None:
        pass


UNTRACED = Untraced()


class RequestStream:
    """One request's outputs as they arrive: RequestOutput deltas, then an end (finish or error).

    It remembers what it needs to resume elsewhere: the original request and the token ids
    delivered; and it carries the request's trace, for dispatch to note where the request went.
    """

    def __init__(self, request: NewRequest, model: str, trace: Trace = UNTRACED) -> None:
        self.request = request
        self.model = model
        self.trace = trace
        self.request_id = request.request_id
        self.worker = b""
        self.queue: asyncio.Queue[RequestOutput | GenerationFailed] = asyncio.Queue()
        self.finished = False
        self.generated: list[int] = []
        self.offset = 0  # tokens generated before the current worker took the request over
        self.retries = 0
        self.cached_tokens: int | None = None
        self.cost = 0  # what it adds to its worker's outstanding tokens
        self.heartbeats_at_assign = 0  # its worker's heartbeat count when it was sent there
        self.wire_id = request.request_id  # the id of its current attempt on the wire (a resume gets a new one)
        self.next_seq = 0  # the sequence number its next output must carry

    def deliver(self, output: RequestOutput) -> None:
        """Hand an output to the reader, its counts as the client sees them, whichever worker
        produced the tokens."""
        self.generated.extend(output.new_token_ids)
        if self.cached_tokens is None and output.new_token_ids:
            self.cached_tokens = output.num_cached_tokens
        output.num_prompt_tokens -= self.offset
        output.num_output_tokens += self.offset
        output.num_cached_tokens = self.cached_tokens or 0
        self.queue.put_nowait(output)

    def resumed_request(self) -> NewRequest:
        """The request as a new worker must run it: the prompt grows by what was already generated."""
        original = self.request
        sampling = original.sampling
        if sampling.seed is not None:  # a fresh generator there: derive its seed from the resume point
            sampling = msgspec.structs.replace(sampling, seed=(sampling.seed + len(self.generated)) % 2**63)
        if self.generated:  # the prompt's logprobs came with the first token already
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
        return msgspec.structs.replace(
            original,
            prompt_token_ids=original.prompt_token_ids + self.generated,
            max_new_tokens=original.max_new_tokens - len(self.generated),
            sampling=sampling,
            resumed_tokens=len(self.generated),
        )


class PrefixAffinity:
    """Remembers which worker last got each prompt prefix (64, 128, 256 and 512 tokens long), so
    requests sharing a long prefix (a system prompt, a conversation) land where it is cached.

    Workers that share a KV store (the same ``kv_store_id`` in their heartbeats: one store, one model
    fingerprint) can all read a prefix one of them computed: the store holds every prefix sent to any
    of them (written behind the prefill). Between those, affinity keeps a prefix on its worker only
    while that worker is no busier than the least loaded one (the RAM hit is still the cheapest);
    otherwise the least loaded worker takes it and loads the prefix from the store (``store_routed``).
    """

    LENGTHS = (512, 256, 128, 64)
    CAPACITY = 50_000

    def __init__(self, slack_tokens: int) -> None:
        self.slack = slack_tokens
        self._owner: OrderedDict[int, bytes] = OrderedDict()
        self.hits = 0
        self.store_routed = 0  # requests sent away from a prefix's worker to one that shares its KV store

    def _keys(self, model: str, prompt: list[int]) -> list[int]:
        return [hash((model, tuple(prompt[:n]))) for n in self.LENGTHS if len(prompt) > n]

    def choose(
        self, model: str, prompt: list[int], candidate: Callable[[bytes], WorkerInfo | None], best: WorkerInfo
    ) -> WorkerInfo:
        """The worker that last got this prompt's longest known prefix (``candidate`` says whether
        it can still take it), unless it is much busier than ``best`` (or busier at all, when
        ``best`` can read the prefix from a KV store they share)."""
        keys = self._keys(model, prompt)
        chosen = best
        for key in keys:  # longest shared prefix first
            owner = self._owner.get(key)
            worker = candidate(owner) if owner is not None else None
            if worker is None:
                continue  # never seen, or its worker left or drains: try a shorter prefix
            shared = worker is not best and worker.load.kv_store_id and worker.load.kv_store_id == best.load.kv_store_id
            if worker.outstanding_tokens <= best.outstanding_tokens + (0 if shared else self.slack):
                chosen = worker
                self.hits += worker is not best
            else:
                self.store_routed += bool(shared)
            break
        for key in keys:
            self._owner[key] = chosen.identity
            self._owner.move_to_end(key)
        while len(self._owner) > self.CAPACITY:
            self._owner.popitem(last=False)
        return chosen


class StartFailures:
    """Workers that said why they could not start (a ``WorkerError`` sent before any ``Ready``), by
    worker name, for ``/health``. Remembered for ``MEMORY_S``: a worker restarted under a new name
    (the default names carry the pid) must not be reported forever."""

    MEMORY_S = 300.0

    def __init__(self) -> None:
        self._by_name: dict[str, tuple[str, float]] = {}

    def note(self, identity: bytes, message: str) -> None:
        name = identity.decode(errors="replace").rsplit("/", 1)[0]  # workers connect as NAME/nonce
        if name not in self._by_name or self._by_name[name][0] != message:
            log.error("worker %s could not start: %s", name, message)
        self._by_name[name] = (message, time.monotonic())

    def recent(self, registered: set[str]) -> list[dict]:
        """The failures of the last ``MEMORY_S`` seconds, but for names that registered since."""
        now = time.monotonic()
        self._by_name = {
            name: seen
            for name, seen in self._by_name.items()
            if now - seen[1] < self.MEMORY_S and name not in registered
        }
        return [
            {"worker": name, "error": message, "seconds_ago": round(now - when, 1)}
            for name, (message, when) in sorted(self._by_name.items())
        ]
