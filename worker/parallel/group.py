"""This process's group of ranks, once joined: what the model runner asks of it (its shard, the
all-reduce, the step broadcast on rank 0) and the settings it changes for each rank."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import torch

from worker.config import WorkerConfig
from worker.parallel import shard as split
from worker.parallel import stages
from worker.parallel.steps import Leader
from worker.parallel.topology import Topology, join, watch
from worker.scheduler import ScheduledBatch
from worker.threads import team_size

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Group:
    topology: Topology
    control: object  # the gloo group each step's batch travels on
    children: list[subprocess.Popen]  # the ranks this process started
    leader: Leader | None  # rank 0's sender; None on the others
    steps: object  # the steps' group once serving (``--dist-timeout``): all-reduces, hidden states
    reducers: tuple[object, object]  # the all-reduces' groups (start-up's, serving's): the world, or this stage
    serving: bool = False  # until then the collectives run on start-up's groups (start-up's timeout)
    watcher: threading.Event | None = None
    layers: range | None = None  # the decoder layers this rank runs; None: all of them

    def reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks of the tensor split, in place (the row-parallel products' partial sums)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self.reducers[self.serving])

    def wire(self) -> object:
        """The group the hidden states between pipeline stages travel on now."""
        return self.steps if self.serving else None

    def shard(self, model: torch.nn.Module) -> None:
        """Cut ``model`` to this rank's share of each layer; before anything reads the model."""
        topology = self.topology
        if topology.tensor > 1:
            split.shard(model, topology.share, topology.tensor, self.reduce)
            log.info("rank %d keeps 1/%d of each layer (worker/parallel/shard.py)", topology.rank, topology.tensor)
        log.info("the C++ step is bypassed: ranks run the torch path")

    def stage(self, model: torch.nn.Module) -> None:
        """Replace the layers other stages run with relays (worker/parallel/stages.py); after the
        probe and the self-check's reference forward, which read every layer."""
        topology = self.topology
        if topology.pipeline > 1:
            first, end = stages.cut(model, topology.stage, topology.pipeline, topology.tensor, topology.rank, self.wire)
            self.layers = range(first, end)
            log.info("rank %d runs layers %d..%d (pipeline stage %d)", topology.rank, first, end - 1, topology.stage)

    def fewest(self, blocks: int, device: torch.device) -> int:
        """The smallest KV block count of all ranks: rank 0's block tables address every rank's cache
        (pipeline stages hold different layers, so their budgets fit different counts)."""
        import torch.distributed as dist

        count = torch.tensor([blocks], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)  # start-up: the default group and its timeout
        return int(count)

    def lead(self, logits: Callable[[ScheduledBatch], T], batch: ScheduledBatch) -> T:
        """Rank 0's step: broadcast the batch, then run its share. A failure here leaves the ranks out
        of step (a rank gone, a collective timed out): the group exits whole, for the launcher to
        restart and the gateways to resume its requests elsewhere, rather than retry parts of it."""
        try:
            self.leader.send(batch)
            return logits(batch)
        except Exception:
            log.critical("a parallel step failed; the group of %d ranks exits", self.topology.world, exc_info=True)
            for child in self.children:
                child.kill()
            os._exit(1)

    def arm(self) -> None:
        """Every rank, once loaded, before the first step: from now on collectives time out after
        ``--dist-timeout`` and a rank that exits takes the group down (during start a refusal
        exits every rank alike)."""
        import torch.distributed as dist

        dist.barrier()  # every rank loaded (the start-up's timeout): rank 0's first batch finds them waiting
        self.serving = True
        self.watcher = watch(self.children)

    def close(self, timeout: float = 30) -> None:
        """Rank 0 at the end: tell the others to stop, and wait for those it started."""
        if self.watcher is not None:
            self.watcher.set()
        if self.leader is not None:
            self.leader.stop()
        for child in self.children:
            try:
                child.wait(timeout)
            except subprocess.TimeoutExpired:
                child.kill()


_CURRENT: Group | None = None


def current() -> Group | None:
    """The group this process joined; None for a lone worker."""
    return _CURRENT


def start(
    config: WorkerConfig, topology: Topology | None, children: list[subprocess.Popen]
) -> tuple[WorkerConfig, Group | None]:
    """Join the group (``children``: the ranks this process started, worker/parallel/topology.py);
    returns the settings this rank runs with (its device, its share of the threads)."""
    global _CURRENT
    if topology is None:
        return config, None
    from worker.runner.choices import pick_device

    device = pick_device(config.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", topology.local_rank % torch.cuda.device_count())
            config = replace(config, device=str(device))
        torch.cuda.set_device(device)  # NCCL's communicator takes the current device
    config = replace(
        config,
        threads=max(1, team_size(config.threads) // topology.local_world),
        cuda_graphs="off",
        quantized_only=False,
    )
    control, steps, reducers = join(topology, device.type, config.dist_timeout)
    _CURRENT = Group(topology, control, children, Leader(control) if topology.leader else None, steps, reducers)
    return config, _CURRENT
