"""How many threads a worker's steps use: sized from the CPUs it may really use, and shrunk while a
core is taken away.

Sizing: the affinity mask (``taskset``, a cpuset), the cgroup's CPU quota (a Kubernetes CPU limit:
``cpu.max`` 150000/100000 is 1.5 CPUs), and the other workers ``serve`` starts on the machine
(``LLMPOOL_THREADS``, set by the launcher from the same figure).

Contention: a step is a few hundred OpenMP parallel regions, each ending at a barrier that waits for
every thread of the team. When another process takes one core, the team's thread there runs only
in the slices the scheduler gives it, and every region waits for it: on 2 cores one busy process
beside the worker made a 128-token answer 9-12x slower. ``AdaptiveTeam`` watches the step times:
when steps of one size run well over their quiet time, it tries a smaller team, keeps it while it
is faster, and tries the full team again after half a second, then after twice as long each time
the smaller team wins again (at most every 8 s), so a comparison spoilt by a moment's load costs
half a second, and the quiet speed comes back with the cores.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

WINDOW = 6  # steps of one size that make a reading
SLOW = 1.6  # a reading this much over the size's quiet time means a core is taken
RETRY_S = 0.5  # how long a smaller team runs before it tries the full one again: doubled each time
RETRY_MAX_S = 8.0  # the smaller team wins again, up to this, and back to RETRY_S when the full team wins


def usable_cpus() -> float:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        cpus: float = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_quota()
    return min(cpus, quota) if quota else cpus


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota in CPUs (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``), None when unlimited."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def team_size(requested: int, share: int = 1) -> int:
    """``requested`` threads, or (0) the usable CPUs split between ``share`` workers, at least one.
    A fractional quota rounds down: 1.5 CPUs run one thread (a second would wait on the quota)."""
    if requested > 0:
        return requested
    return max(1, math.floor(usable_cpus() / max(1, share)))


class AdaptiveTeam:
    """Fed each step's time and size (``observe``), it sets the team size (``set_threads``).

    Per size of step it keeps the last reading of each team size tried (a median over WINDOW steps)
    and the full team's best. The full team gives way to one thread fewer when its reading is well
    over its best, or over the smaller team's last reading, and once for each new size of step (so
    a worker that starts on a busy machine finds out too); a smaller team gives way back when it is
    no faster than the full team's last reading, and after ``retry`` seconds to look again: RETRY_S
    at first (a reading spoilt by a moment's load, a process starting beside the worker, is put
    right at once), doubled each time the full team loses again (a neighbour that stays costs a few
    slow steps every RETRY_MAX_S), and RETRY_S again once the full team keeps its place.
    """

    def __init__(
        self, threads: int, set_threads: Callable[[int], None], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.full = threads
        self.threads = threads
        self._set = set_threads
        self._clock = clock
        self._last: dict[tuple[int, int], float] = {}  # (threads, size) -> the last reading
        self._best: dict[int, float] = {}  # size -> the full team's best reading
        self._recent: dict[int, deque[float]] = {}  # size -> this team's step times since the last reading
        self._since = clock()  # when the team last changed
        self.retry = RETRY_S  # how long the smaller team runs before the full one is tried again
        self.changes = 0

    @staticmethod
    def size_of(tokens: int) -> int:
        """Steps are compared within a power-of-two bucket of the tokens they compute."""
        return 1 << max(0, tokens - 1).bit_length()

    def observe(self, seconds: float, tokens: int) -> None:
        if self.full <= 1 or tokens <= 0:
            return
        size = self.size_of(tokens)
        recent = self._recent.setdefault(size, deque(maxlen=WINDOW))
        recent.append(seconds)
        if len(recent) < WINDOW:
            return
        reading = statistics.median(recent)
        recent.clear()
        self._last[(self.threads, size)] = reading
        smaller = self._last.get((self.full - 1, size))
        if self.threads == self.full:
            best = self._best[size] = min(self._best.get(size, reading), reading)
            if smaller is None:
                self._change(self.full - 1, f"comparing teams on steps of {size} tokens")
            elif reading > SLOW * best or reading > smaller:
                self._change(
                    self.full - 1,
                    f"steps of {size} tokens take {reading * 1e3:.1f} ms ({reading / best:.1f}x the quiet time)",
                )
            else:
                self.retry = RETRY_S
        elif reading >= self._last.get((self.full, size), math.inf):
            self._change(self.full, f"{self.threads} threads are no faster on steps of {size} tokens")
        elif self._clock() - self._since > self.retry:
            self._change(self.full, f"looking at the full team again after {self.retry:.1f} s")
            self.retry = min(2 * self.retry, RETRY_MAX_S)

    def _change(self, threads: int, why: str) -> None:
        previous, self.threads = self.threads, threads
        self._set(threads)
        self._since = self._clock()
        for recent in self._recent.values():
            recent.clear()
        self.changes += 1
        log.info("step threads %d -> %d: %s", previous, threads, why)
