"""The gateway's records of the pool: what it knows of each worker, of each request in flight
(enough to resume it elsewhere), and which worker a prompt prefix was last sent to."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from common.protocol import Heartbeat, NewRequest, Ready, RequestOutput
from gateway.errors import GenerationFailed


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

    def snapshot(self) -> dict:
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
            "steps_seen": self.steps_seen,
            "batched_steps": self.batched_steps,
            "peak_batch_size": max(self.peak_batch_size, self.load.peak_batch_size),
            "draining": self.load.draining,
        }


class RequestStream:
    """One request's outputs as they arrive: RequestOutput deltas, then an end (finish or error).

    It remembers what it needs to resume elsewhere: the original request and the token ids delivered.
    """

    def __init__(self, request: NewRequest) -> None:
        self.request = request
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

    def resumed_request(self) -> NewRequest:
        """The request as a new worker must run it: the prompt grows by what was already generated."""
        original = self.request
        sampling = original.sampling
        if sampling.seed is not None:  # a fresh generator there: derive its seed from the resume point
            sampling = replace(sampling, seed=(sampling.seed + len(self.generated)) % 2**63)
        if self.generated:  # the prompt's logprobs came with the first token already
            sampling = replace(sampling, prompt_logprobs=None)
        return replace(
            original,
            prompt_token_ids=original.prompt_token_ids + self.generated,
            max_new_tokens=original.max_new_tokens - len(self.generated),
            sampling=sampling,
            resumed_tokens=len(self.generated),
        )


class PrefixAffinity:
    """Remembers which worker last got each prompt prefix (64, 128, 256 and 512 tokens long), so
    requests sharing a long prefix (a system prompt, a conversation) land where it is cached."""

    LENGTHS = (512, 256, 128, 64)
    CAPACITY = 50_000

    def __init__(self, slack_tokens: int) -> None:
        self.slack = slack_tokens
        self._owner: OrderedDict[int, bytes] = OrderedDict()
        self.hits = 0

    def _keys(self, prompt: list[int]) -> list[int]:
        return [hash(tuple(prompt[:n])) for n in self.LENGTHS if len(prompt) > n]

    def choose(self, prompt: list[int], available: list[WorkerInfo], least_loaded: WorkerInfo) -> WorkerInfo:
        """The worker that last got this prompt's longest known prefix, unless it is much busier."""
        keys = self._keys(prompt)
        by_identity = {w.identity: w for w in available}
        chosen = least_loaded
        for key in keys:  # longest shared prefix first
            owner = by_identity.get(self._owner.get(key, b""))
            if owner is not None:
                if owner.outstanding_tokens <= least_loaded.outstanding_tokens + self.slack:
                    chosen = owner
                    self.hits += owner is not least_loaded
                break
        for key in keys:
            self._owner[key] = chosen.identity
            self._owner.move_to_end(key)
        while len(self._owner) > self.CAPACITY:
            self._owner.popitem(last=False)
        return chosen
