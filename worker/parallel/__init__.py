"""Tensor parallel: one model split across several ranks of one worker (``--tensor-parallel-size``).

    topology.py  where this process sits (flags, torchrun's variables), starting the local ranks,
                 joining torch.distributed, and the watch that makes the group live and die as one
    group.py     the joined group as the model runner uses it; the flags it refuses
    shard.py     the split plan: column-parallel q/k/v/gate/up, row-parallel o/down with an all-reduce
    steps.py     each step's batch, broadcast by rank 0 and run by the others (``follow``)

Rank 0 is the worker the gateways see: it alone holds the DEALER socket, schedules and samples.
docs/parallel.md says how to run it on one machine, with torchrun, compose or a LeaderWorkerSet.
"""

from worker.parallel.group import Group, current, start
from worker.parallel.steps import follow

__all__ = ["Group", "current", "follow", "start"]
