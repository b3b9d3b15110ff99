"""CUDA graphs of decode steps: one graph per batch-size bucket, replayed with the step's rows copied
into static input tensors.

Why: an eager decode step launches a few hundred small kernels (about 20 per layer), and on a GPU the
host cannot launch them as fast as the GPU runs them. Measured on an H100 before this module, a
batch-1 step took 22 ms for the default model (30 layers) and 12.6 ms for a 1B Llama (16 layers),
where reading the 1B model's weights once takes about 0.7 ms. A replay launches the whole step in
one call.

What it needs: every launch shape must depend on tensor shapes only. The rows of a bucket are padded
(token 0 at position 0, context length 1, writing its key and value to a scratch slot outside the
block manager's blocks), block tables are as wide as the longest sequence allowed, and attention is
the Triton kernel, which reads each row's context length from a tensor (worker/attention/triton_decode.py),
or FlashInfer with one fixed-buffer schedule per bucket, planned on the host before each replay
(worker/attention/flashinfer_decode.py). Prompt chunks and mixed steps keep the eager path, as do float32
workers (token-identical to ``generate`` there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from worker.attention import AttentionMetadata, DecodeBackend, DecodeGroup
from worker.attention.flashinfer_decode import FlashInferDecode

log = logging.getLogger(__name__)

# vLLM's choice of sizes: every power of two to 8, then steps of 8, 16 and 32 as batches grow; a
# batch runs in the smallest bucket that holds it.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# (input_ids [1, T], positions [1, T], metadata, logits_indices [T]) -> logits [T, vocab]
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor], torch.Tensor]


class DecodeGraphs:
    """Captured decode steps of up to ``max_rows`` rows over ``kv_caches``, whose block ``num_blocks``
    (one past the block manager's) is the padding rows' scratch. Attention is ``backend``: FlashInfer
    (one schedule per bucket, in its ``workspace``) or the Triton kernel."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        heads: int,
        max_blocks: int,
        num_blocks: int,
        max_rows: int,
        backend: DecodeBackend,
    ) -> None:
        device = kv_caches[0][0].device
        block_size = kv_caches[0][0].shape[1]
        self.buckets = sorted({b for b in BUCKETS if b < max_rows} | {max_rows})
        self.max_rows = max_rows
        self.pad_block = num_blocks
        self.pad_slot = num_blocks * block_size
        n = self.buckets[-1]
        # One tensor for the per-row inputs, so a step fills them with one copy: ids, positions, slots, lengths.
        self.inputs = torch.zeros(4, n, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, max_blocks, dtype=torch.long, device=device)
        self.rows = torch.arange(n, device=device)
        # FlashInfer: a schedule per bucket, its buffers fixed at capture and refilled by plan() before a replay.
        self.backend = backend
        self.schedules: dict[int, FlashInferDecode] = {}
        workspace = getattr(backend, "workspace", None)
        if workspace is not None:
            self.schedules = {
                b: FlashInferDecode(kv_caches[0][0], heads, workspace, rows=b, max_blocks=max_blocks)
                for b in self.buckets
            }
        self._graphs: dict[int, tuple[torch.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # steps run from a graph (tests and metrics read it)
        self._capture(forward, kv_caches, block_size * max_blocks)

    @torch.inference_mode()
    def _capture(self, forward: Forward, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_len: int) -> None:
        start = time.perf_counter()
        ids, positions, slots, lengths = self.inputs
        slots.fill_(self.pad_slot)
        lengths.fill_(1)
        pool = None
        for b in reversed(self.buckets):  # largest first, so the smaller ones reuse its memory pool
            group = DecodeGroup(0, b, self.tables[:b], lengths[:b], max_len, self._plan(b, [], []))
            meta = AttentionMetadata(kv_caches, slots[:b], b, [group], [], self.backend)
            args = (ids[:b].unsqueeze(0), positions[:b].unsqueeze(0), meta, self.rows[:b])
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile the Triton kernels and let the allocator settle outside the capture
                forward(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(*args)
            pool = graph.pool()
            self._graphs[b] = (graph, logits)
        torch.cuda.synchronize()
        log.info(
            "captured %d CUDA graphs of decode steps (1 to %d rows, %s attention) in %.1f s",
            len(self.buckets),
            self.max_rows,
            self.backend.name,
            time.perf_counter() - start,
        )

    def _plan(self, bucket: int, tables: list[list[int]], lengths: list[int]) -> FlashInferDecode | None:
        """FlashInfer's schedule of the bucket for these rows, the padding rows reading the scratch block."""
        schedule = self.schedules.get(bucket)
        if schedule is not None:
            pad = bucket - len(lengths)
            schedule.plan(tables + [[self.pad_block]] * pad, lengths + [1] * pad)
        return schedule

    def run(
        self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]], lengths: list[int]
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step; valid until the next ``run``."""
        rows = len(ids)
        bucket = next(b for b in self.buckets if b >= rows)
        pad = bucket - rows
        host = torch.tensor(
            [ids + [0] * pad, positions + [0] * pad, slots + [self.pad_slot] * pad, lengths + [1] * pad],
            dtype=torch.long,
        )
        self.inputs[:, :bucket].copy_(host)
        if (
            self._plan(bucket, tables, lengths) is None
        ):  # the Triton kernel reads the block tables from the graph's input
            # Columns past the widest table keep older ids: a row reads only its first lengths[r] positions.
            width = max(map(len, tables))
            self.tables[:rows, :width].copy_(
                torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
            )
        graph, logits = self._graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:rows]
