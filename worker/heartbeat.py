"""What a worker's heartbeats say, and when each gateway is due one.

Any message counts as a heartbeat both ways (the Paranoid Pirate pattern); the worker also sends its
load every ``interval``: queue lengths, free KV blocks, speed, and whether it drains. A step may run
for longer than the gateways' liveness (a long prefill chunk on a CPU, a first-use import):
heartbeats go on meanwhile, with the load read at the last hand-over of the engine, so a busy
worker is never taken for a dead one (a step that never ends is the gateway's hung-worker check to
catch).
"""

from __future__ import annotations

import math
import time

import msgspec

from common.protocol import Heartbeat

CAPACITY_WINDOW_S = 5.0  # seconds of busy step time the capacity figure averages over
CAPACITY_STALE_S = 10.0  # a figure older than this (the worker idle) is withdrawn


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


class Vitals:
    """The load a heartbeat reports: the engine's as last read, with the figures the socket side keeps."""

    def __init__(self) -> None:
        self.capacity = CapacityMeter()
        self.draining = False
        self._held = Heartbeat()  # the engine's load when the socket loop last held it

    def held(self, load: Heartbeat) -> Heartbeat:
        """The engine is the socket loop's: its ``load`` now."""
        self._held = self._with_own_figures(load)
        return self._held

    def during_step(self, arrived: int) -> Heartbeat:
        """The load while a step runs (the engine is not ours to read): as at the last hand-over,
        with the ``arrived`` requests since counted as waiting. It may count requests that have
        finished since, never fewer than the worker holds: a gateway resumes elsewhere the
        requests a worker says it does not hold."""
        return self._with_own_figures(msgspec.structs.replace(self._held, waiting=self._held.waiting + arrived))

    def _with_own_figures(self, load: Heartbeat) -> Heartbeat:
        load.draining = self.draining
        load.capacity_tokens_per_s = round(self.capacity.tokens_per_s, 1)
        return load
