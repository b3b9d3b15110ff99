"""Thread sizing from the CPUs a worker may use, and the team that shrinks while a core is taken."""

import os
import subprocess
import sys

import pytest

from worker.threads import RETRY_MAX_S, RETRY_S, WINDOW, AdaptiveTeam, cgroup_quota, team_size


def test_quota_files_of_both_cgroup_versions(tmp_path):
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_quota(tmp_path) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert cgroup_quota(v1) == 0.5


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs and affinity masks"
)
def test_a_worker_sizes_its_team_from_its_affinity_mask():
    """Started under a one-CPU mask (taskset), a worker's step threads are one, not the machine's count."""
    code = "import os, torch; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from worker.threads import team_size; print(team_size(0))"
    masked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert masked == "1"
    assert team_size(0) == len(os.sched_getaffinity(0)) and team_size(3) == 3 and team_size(0, share=8) == 1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def feed(team: AdaptiveTeam, clock: Clock, times: dict[int, float], steps: int, tokens: int = 1) -> None:
    """``steps`` steps, each taking what ``times`` says for the team size in force."""
    for _ in range(steps):
        clock.now += times[team.threads]
        team.observe(times[team.threads], tokens)


def test_the_team_shrinks_while_a_core_is_taken_and_grows_back_when_it_is_free():
    clock, sizes = Clock(), []
    team = AdaptiveTeam(2, sizes.append, clock)
    quiet, busy = {2: 0.003, 1: 0.005}, {2: 0.030, 1: 0.006}
    feed(team, clock, quiet, 4 * WINDOW)  # a quiet start: one comparison, then back to both threads
    assert sizes == [1, 2] and team.threads == 2
    feed(team, clock, busy, 2 * WINDOW)  # a busy neighbour: steps 10x slower with 2 threads, 1 thread is faster
    assert team.threads == 1
    feed(team, clock, busy, 2000)  # retries now and then, and goes back to one thread each time
    assert team.threads == 1 and 2 in sizes[2:]
    feed(team, clock, quiet, 2000)  # the neighbour left: the full team's speed comes back and stays
    assert team.threads == 2
    changes = team.changes
    feed(team, clock, quiet, 200)
    assert team.changes == changes, "a quiet machine keeps its team"


def test_one_thread_or_no_steps_change_nothing():
    sizes: list[int] = []
    team = AdaptiveTeam(1, sizes.append, Clock())
    for _ in range(50):
        team.observe(1.0, 1)
    assert sizes == []


def test_a_comparison_spoilt_by_a_moments_load_is_put_right_in_half_a_second():
    """The full team's first reading lands while another process starts (slow), so one thread looks
    faster; the full team is tried again after RETRY_S, not after seconds of one-thread steps."""
    clock, sizes = Clock(), []
    team = AdaptiveTeam(2, sizes.append, clock)
    feed(team, clock, {2: 0.012, 1: 0.005}, WINDOW)  # spoilt: both threads slower than one
    feed(team, clock, {2: 0.003, 1: 0.005}, WINDOW)  # the moment has passed: one thread keeps its reading
    assert team.threads == 1
    start = clock.now
    while team.threads == 1:
        feed(team, clock, {2: 0.003, 1: 0.005}, 1)
    assert clock.now - start < 1.0, "one-thread steps for a second or more on a quiet machine"
    feed(team, clock, {2: 0.003, 1: 0.005}, 1000)
    assert team.threads == 2 and team.retry == RETRY_S


def test_a_neighbour_that_stays_is_looked_at_less_and_less_often():
    """Each retry the smaller team wins again doubles the wait before the next one, up to RETRY_MAX_S."""
    clock, back = Clock(), []
    team = AdaptiveTeam(2, lambda n: back.append(clock.now) if n == 2 else None, clock)
    feed(team, clock, {2: 0.030, 1: 0.006}, 10_000)  # 60 s beside a busy neighbour
    gaps = [b - a for a, b in zip(back, back[1:])]
    assert len(back) >= 8 and all(b > a - 0.1 for a, b in zip(gaps, gaps[1:]))
    assert gaps[0] < 1.5 and RETRY_MAX_S <= gaps[-1] < RETRY_MAX_S + 1
