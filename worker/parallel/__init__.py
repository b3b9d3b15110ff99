"""Tensor and pipeline parallel: one model split across several ranks of one worker
(``--tensor-parallel-size``, ``--pipeline-parallel-size``; world = tensor x pipeline ranks).

    topology.py  where this process sits (flags, torchrun's variables), the flags it refuses, starting
                 the local ranks, joining torch.distributed, the watch that makes the group one
    group.py     the joined group as the model runner uses it (shard, all-reduce, rank 0's step)
    shard.py     the split plan: column-parallel q/k/v/gate/up, row-parallel o/down with an all-reduce
                 (MoE experts cut alike; families planned by name or by transformers' own tp_plan)
    stages.py    pipeline stages: the layers a rank does not run become relays that send and receive
                 the hidden state; each stage caches its own layers
    steps.py     each step's batch, broadcast by rank 0 and run by the others (``follow``)

Import the modules themselves: topology.py imports no torch, so a worker starts its ranks before its
own heavy imports, and their imports overlap. Rank 0 is the worker the gateways see: it alone holds the DEALER socket, schedules and samples.
docs/parallel.md says how to run it on one machine, with torchrun, compose or a LeaderWorkerSet.
"""
