"""Where this process sits in a worker's group of ranks, how the group starts, and how it dies as one.

A worker with ``--tensor-parallel-size N`` is rank 0: it starts the other ranks of its machine as
child processes (``python -m worker`` with the same flags, and torchrun's variables RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set), then all join one torch.distributed
group. A process started by torchrun (those variables already set) starts nobody. With ``--nnodes``
each machine's first process starts that machine's ranks; rank 0 alone talks to the gateways.

Failures: each rank child is set to die with its parent (PR_SET_PDEATHSIG), rank 0 watches its
children and exits when one does (the launcher then restarts the whole group, and the gateways
resume its requests elsewhere as for any dead worker), and every step's collectives carry
``--dist-timeout``, so a hung rank is noticed too.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

from worker.config import WorkerConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# The control group carries each step's batch from rank 0; the others wait on it between steps,
# however long the worker sits idle, so their side of it has no practical timeout.
IDLE_TIMEOUT = timedelta(days=365)
START_TIMEOUT = 600.0  # seconds the ranks may take to start and load the model alongside each other


@dataclass(frozen=True, slots=True)
class Topology:
    """This process's place: its rank in a world of ``tensor * pipeline`` ranks."""

    tensor: int
    pipeline: int
    rank: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    by_torchrun: bool  # the ranks were started for us (torchrun, or our own rank 0): start none

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def stage(self) -> int:
        """This rank's pipeline stage: stage ``s`` is ranks ``s*tensor .. s*tensor+tensor-1``."""
        return self.rank // self.tensor

    @property
    def share(self) -> int:
        """This rank's tensor share within its stage."""
        return self.rank % self.tensor


def resolve(config: WorkerConfig, environ: dict[str, str] | None = None) -> Topology | None:
    """The topology the flags (and torchrun's variables) ask for; None for a lone worker. Raises
    ValueError, in one sentence, for sizes that cannot work together."""
    env = os.environ if environ is None else environ
    tensor, pipeline, nnodes = config.tensor_parallel_size, config.pipeline_parallel_size, config.nnodes
    if tensor < 1 or pipeline < 1 or nnodes < 1:
        raise ValueError("--tensor-parallel-size, --pipeline-parallel-size and --nnodes must be at least 1")
    world = tensor * pipeline
    if world == 1:
        if nnodes > 1 or config.headless:
            raise ValueError("--nnodes and --headless need --tensor-parallel-size or --pipeline-parallel-size > 1")
        return None
    refuse(config)
    if world % nnodes:
        raise ValueError(f"--nnodes {nnodes} does not divide the world size {world} (tensor x pipeline)")
    local_world = world // nnodes
    if "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != world:
            raise ValueError(
                f"WORLD_SIZE={env['WORLD_SIZE']} (torchrun) but --tensor-parallel-size x --pipeline-parallel-size is {world}"
            )
        rank = int(env["RANK"])
        return Topology(
            tensor,
            pipeline,
            rank,
            int(env.get("LOCAL_RANK", rank % local_world)),
            local_world,
            env.get("MASTER_ADDR", config.master_addr),
            int(env.get("MASTER_PORT", config.master_port)),
            True,
        )
    if not 0 <= config.node_rank < nnodes:
        raise ValueError(f"--node-rank must be in 0..{nnodes - 1}; got {config.node_rank}")
    if config.headless and config.node_rank == 0:
        raise ValueError("--headless is for the other machines: node 0 holds rank 0, which serves the gateways")
    port = config.master_port
    if port == 0:
        if nnodes > 1:
            raise ValueError("--nnodes > 1 needs --master-port (every machine must name the same one)")
        port = _free_port()
    rank = config.node_rank * local_world
    return Topology(tensor, pipeline, rank, 0, local_world, config.master_addr, port, False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_local_ranks(topology: Topology, argv: list[str]) -> list[subprocess.Popen]:
    """This machine's other ranks, as ``python -m worker`` children with torchrun's variables set."""
    if topology.by_torchrun:
        return []
    children = []
    for local in range(1, topology.local_world):
        env = {
            **os.environ,
            "RANK": str(topology.rank + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(topology.world),
            "MASTER_ADDR": topology.master_addr,
            "MASTER_PORT": str(topology.master_port),
        }
        children.append(subprocess.Popen([sys.executable, "-m", "worker", *argv], env=env, preexec_fn=_die_with_parent))
        log.info("started rank %d (pid %d)", topology.rank + local, children[-1].pid)
    return children


def _die_with_parent() -> None:
    """In the child before exec: the kernel kills it when the rank that started it goes away."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def watch(children: list[subprocess.Popen], interval: float = 0.2) -> threading.Event:
    """A thread that ends this process when one of its ranks exits: the group lives and dies as one.
    Setting the returned event stands it down (a stop rank 0 asked for)."""
    done = threading.Event()

    def run() -> None:
        while not done.wait(interval):
            for child in children:
                code = child.poll()
                if code is not None:
                    log.error("rank process %d exited with code %s; the group stops", child.pid, code)
                    for other in children:
                        if other.poll() is None:
                            other.kill()
                    os._exit(1)

    if children:
        threading.Thread(target=run, name="rank-watch", daemon=True).start()
    return done


def join(topology: Topology, device_type: str, timeout: float) -> tuple[object, object, tuple[object, object]]:
    """Join the torch.distributed group (NCCL on CUDA, else gloo). Returns the gloo group that
    carries each step's batch, the group of the steps' collectives (all-reduces, and the hidden
    states between pipeline stages), whose collectives time out after ``timeout`` seconds, and the
    all-reduces' groups (start-up's, steps'): the whole world, or with pipeline stages this rank's
    stage. The default group, which the start-up uses (the rendezvous, and the probe's and
    self-check's forwards while ranks load at their own pace), waits ``START_TIMEOUT``."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{topology.master_addr}:{topology.master_port}",
        rank=topology.rank,
        world_size=topology.world,
        timeout=timedelta(seconds=max(timeout, START_TIMEOUT)),
    )
    steps = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout))
    reducers = (None, steps)
    if topology.pipeline > 1:  # each stage's all-reduces among its own ranks (every rank makes every group)
        for stage in range(topology.pipeline):
            ranks = list(range(stage * topology.tensor, (stage + 1) * topology.tensor))
            pair = tuple(
                dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=seconds))
                for seconds in (max(timeout, START_TIMEOUT), timeout)
            )
            if stage == topology.stage:
                reducers = pair
    # Rank 0 sends with the step's timeout (a stopped rank must not wedge it); the others wait for
    # the next batch as long as the worker is idle. gloo's timeout is each process's own.
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout) if topology.leader else IDLE_TIMEOUT)
    log.info("rank %d of %d joined (%s)", topology.rank, topology.world, backend)
    return control, steps, reducers


def refuse(config: WorkerConfig) -> None:
    """ValueError, in one sentence, for a flag whose work is not split across ranks."""
    size = " and ".join(
        f"--{name}-parallel-size {value}"
        for name, value in (("tensor", config.tensor_parallel_size), ("pipeline", config.pipeline_parallel_size))
        if value > 1
    )
    clashes = {
        "--lora": bool(config.lora),
        "--speculate": config.speculate > 0,
        "--kv-store": bool(config.kv_store),
        "--quantization": config.quantization not in ("auto", "none"),
        "--quantized-only": bool(config.quantized_only),
        "--cuda-graphs on": config.cuda_graphs == "on",
        "--pooling": config.pooling not in ("auto", "none"),
    }
    named = [flag for flag, clash in clashes.items() if clash]
    if named:
        raise ValueError(
            f"{', '.join(named)} cannot be used with {size}: the ranks run the torch path on split float weights "
            "(the C++ quantized step, adapters, drafts, graphs and pooling hold whole layers)"
        )
