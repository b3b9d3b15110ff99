"""Paged decode attention through FlashInfer, a maintained CUDA kernel library, where it installs.

FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` reads our cache as it is: a ``(k_cache,
v_cache)`` pair of ``[num_blocks, block_size, kv_heads, head_dim]`` tensors is its "NHD" layout with
any page size (flash-attn's paged ``flash_attn_with_kvcache`` wants pages of 256 tokens, 16x ours,
which is why it is not used). It splits long contexts over the GPU itself (its planner decides
from the lengths) and shares each KV head among its query heads (GQA groups 1-4, 6, 8, 16).

Its use differs from the Triton kernel's (worker/attention/triton_decode.py) in one way: the work
schedule is made on the host, once per step, by ``plan`` (page counts per row, split sizes), and
each layer then calls ``run``. So a ``FlashInferDecode`` is planned by the model runner when it
prepares a step, travels in the step's ``DecodeGroup``, and is called by every layer. Under CUDA
graphs each batch-size bucket has its own, made with fixed buffers (FlashInfer's
``use_cuda_graph``): ``plan`` before each replay refills the buffers the captured kernels read.

The package is optional (pyproject's ``flashinfer`` extra): this module imports without it, and
``available()`` says whether it can be tried. It compiles its kernels on first use (nvcc), which
``check`` does at worker start (worker/attention/chooser.py) while comparing one batch against the
eager gather; a worker whose check fails falls back to the Triton kernel.
"""

from __future__ import annotations

import logging
import time

import torch

from worker.attention.backend import DecodeBackend
from worker.attention.eager_decode import EagerDecode
from worker.attention.metadata import DecodeGroup

log = logging.getLogger(__name__)

try:
    import flashinfer
except Exception:  # CI and the CPU install have none; a broken install must not stop the worker
    flashinfer = None

WORKSPACE_BYTES = 128 << 20  # the size FlashInfer's documentation recommends for split-KV scratch
DTYPES = (torch.float16, torch.bfloat16)  # its decode kernels' types; float32 workers stay eager


def available() -> bool:
    """Whether FlashInfer imported and a CUDA device is here."""
    try:
        return flashinfer is not None and torch.cuda.is_available()
    except Exception:  # a broken CUDA driver must not take the worker down
        return False


def page_layout(
    tables: list[list[int]], lengths: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR description of the rows' pages, as int32 host tensors: ``indptr`` ``[rows + 1]``
    (row r's pages are ``indices[indptr[r]:indptr[r + 1]]``), ``indices`` (block ids, only the blocks
    that hold context: a table may have blocks reserved past it) and ``last_page_len`` ``[rows]``
    (tokens in each row's last page, 1 to block_size)."""
    pages = [-(-n // block_size) for n in lengths]
    indptr = [0]
    for count in pages:
        indptr.append(indptr[-1] + count)
    indices = [block for table, count in zip(tables, pages) for block in table[:count]]
    last = [n - (count - 1) * block_size for n, count in zip(lengths, pages)]
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    return as_int32(indptr), as_int32(indices), as_int32(last)


class FlashInferDecode:
    """One FlashInfer decode schedule over a worker's caches: ``plan`` once per step, call once per layer.

    ``rows`` > 0 makes the CUDA-graph variant: exactly ``rows`` rows per plan, of at most
    ``max_blocks`` pages each, in fixed device buffers that a captured graph keeps reading.
    """

    def __init__(
        self, k_cache: torch.Tensor, heads: int, workspace: torch.Tensor, rows: int = 0, max_blocks: int = 0
    ) -> None:
        _, self.block_size, self.kv_heads, self.head_dim = k_cache.shape
        self.heads = heads
        self.dtype = k_cache.dtype
        self.scale = self.head_dim**-0.5
        buffers = {}
        if rows:
            device = k_cache.device
            buffers = {
                "use_cuda_graph": True,
                "paged_kv_indptr_buffer": torch.zeros(rows + 1, dtype=torch.int32, device=device),
                "paged_kv_indices_buffer": torch.zeros(rows * max_blocks, dtype=torch.int32, device=device),
                "paged_kv_last_page_len_buffer": torch.zeros(rows, dtype=torch.int32, device=device),
            }
        self._wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", **buffers)

    def plan(self, tables: list[list[int]], lengths: list[int]) -> None:
        """Schedule this step's rows (row r attends to its first ``lengths[r]`` positions)."""
        indptr, indices, last = page_layout(tables, lengths, self.block_size)
        self._wrapper.plan(
            indptr,
            indices,
            last,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.block_size,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            sm_scale=self.scale,
        )

    def __call__(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """``[rows, heads, head_dim]`` attention output of ``query`` (same shape) over the planned rows."""
        if scaling != self.scale:  # the plan fixed 1/sqrt(head_dim); another softmax scale moves into the query
            query = query * (scaling / self.scale)
        return self._wrapper.run(query, (k_cache, v_cache))


def make_workspace(device: torch.device) -> torch.Tensor:
    """The float scratch FlashInfer's split-KV decode writes; one per worker, shared by its schedules
    (steps and graph replays run one at a time)."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def check(heads: int, page: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> str | None:
    """Run FlashInfer once on random caches of ``page`` shape ``(block_size, kv_heads, head_dim)`` and
    compare it with the eager gather (worker/attention/eager_decode.py): None when it agrees, else why not.
    Compiles its kernels too (the first start on a machine runs nvcc, so it can take a minute)."""
    block_size, _, head_dim = page
    generator = torch.Generator(device=device).manual_seed(0)
    lengths = [
        1,
        block_size,
        5 * block_size + 3,
        40 * block_size,
    ]  # one token, one full page, a partial page, a long row
    blocks = sum(-(-n // block_size) for n in lengths)
    keys, values = (torch.randn(blocks + 1, *page, generator=generator, device=device, dtype=dtype) for _ in range(2))
    order = torch.randperm(blocks, generator=generator, device=device).tolist()  # pages in no particular order
    tables, start = [], 0
    for n in lengths:
        count = -(-n // block_size)
        tables.append(
            order[start : start + count] + [blocks]
        )  # one reserved block past the context, as a running row may have
        start += count
    query = torch.randn(len(lengths), heads, head_dim, generator=generator, device=device, dtype=dtype)
    scale = head_dim**-0.5
    width = max(map(len, tables))
    group = DecodeGroup(
        0,
        len(lengths),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        torch.tensor(lengths, device=device),
        max(lengths),
    )
    started = time.perf_counter()
    try:
        decode = FlashInferDecode(keys, heads, make_workspace(device))
        decode.plan(tables, lengths)
        got = decode(query, keys, values, scale).float()
        want = EagerDecode()(query, keys, values, group, scale).float()
        error = (got - want).abs().max().item()
    except Exception as exc:  # an unsupported shape, a failed compile, an API this code does not know
        return f"{type(exc).__name__}: {exc}"
    if (
        not error <= 5e-2
    ):  # both round to bf16 (4e-3 relative) at different points; a wrong page or length is off by ~0.5
        return f"differs from the eager gather by up to {error:.3g}"
    log.info(
        "FlashInfer %s decode checked against the eager gather in %.1f s",
        flashinfer.__version__,
        time.perf_counter() - started,
    )
    return None


class FlashInferBackend(DecodeBackend):
    """Eager steps' decode rows: one schedule, planned once per step (``plan``) and called by every
    layer; CUDA graphs make one per bucket from ``workspace`` (worker/runner/cuda_graphs.py)."""

    name = "flashinfer"
    in_place_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.workspace = make_workspace(device)
        self._decode: FlashInferDecode | None = None

    def prepare(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], heads: int) -> None:
        self._decode = FlashInferDecode(kv_caches[0][0], heads, self.workspace)

    def plan(self, group: DecodeGroup, tables: list[list[int]], lengths: list[int]) -> None:
        self._decode.plan(tables, lengths)
        group.planned = self._decode

    def __call__(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup, scale: float
    ) -> torch.Tensor:
        return group.planned(query, k_cache, v_cache, scale)
