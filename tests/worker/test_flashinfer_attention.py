"""worker/attention/flashinfer_decode.py without a GPU: the page layout it hands FlashInfer, its start-up
check, and the model runner's schedule-per-step flow, driven through a stand-in for FlashInfer's
decode wrapper that computes what FlashInfer's documentation says ``plan`` and ``run`` compute.

CI has neither a GPU nor FlashInfer; tests/gpu/test_cuda.py runs the real library where both are.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.config import CACHE_DIR
from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from worker.attention import flashinfer_decode
from worker.attention.flashinfer_decode import FlashInferBackend, FlashInferDecode, check, page_layout
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.loader import load_model


class ContractWrapper:
    """``BatchDecodeWithPagedKVCacheWrapper`` as FlashInfer documents it, NHD layout, in plain torch."""

    plans = 0
    runs = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str, **graph_buffers: object) -> None:
        assert kv_layout == "NHD"

    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        q_data_type,
        kv_data_type,
        sm_scale,
    ):
        assert indptr.dtype == indices.dtype == last_page_len.dtype == torch.int32
        assert len(indptr) == len(last_page_len) + 1 and indptr[-1] == len(indices)
        assert ((last_page_len >= 1) & (last_page_len <= page_size)).all(), (
            "FlashInfer wants 1 <= last_page_len <= page_size"
        )
        self.layout = (
            indptr.tolist(),
            indices.tolist(),
            last_page_len.tolist(),
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
        )
        self.scale = sm_scale
        type(self).plans += 1

    def context_length(self, pages: int, last: int, page_size: int) -> int:
        return (pages - 1) * page_size + last

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        indptr, indices, last, heads, kv_heads, head_dim, page_size = self.layout
        k_cache, v_cache = paged_kv_cache
        out = []
        for r in range(len(last)):
            pages = indices[indptr[r] : indptr[r + 1]]
            n = self.context_length(len(pages), last[r], page_size)
            k, v = (cache[pages].reshape(-1, kv_heads, head_dim)[:n].float() for cache in (k_cache, v_cache))
            query = q[r].view(kv_heads, heads // kv_heads, head_dim).float()
            weights = (torch.einsum("hgd,nhd->hgn", query, k) * self.scale).softmax(-1)
            out.append(torch.einsum("hgn,nhd->hgd", weights, v).reshape(heads, head_dim))
        type(self).runs += 1
        return torch.stack(out).to(q.dtype)


class WholePagesWrapper(ContractWrapper):
    """A misreading of the layout: every page counted full, so rows see slots past their context."""

    def context_length(self, pages: int, last: int, page_size: int) -> int:
        return pages * page_size


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    def use(wrapper: type) -> None:
        monkeypatch.setattr(
            flashinfer_decode,
            "flashinfer",
            SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=wrapper, __version__="stand-in"),
        )
        monkeypatch.setattr(flashinfer_decode, "make_workspace", lambda device: torch.zeros(16, dtype=torch.uint8))

    return use


def test_page_layout_lists_each_rows_context_pages_only():
    # Row 0: 17 tokens over two pages (one reserved block past them); row 1: one token; row 2: two full pages.
    indptr, indices, last = page_layout([[7, 3, 9], [4], [5, 6]], [17, 1, 32], 16)
    assert indptr.tolist() == [0, 2, 3, 5]
    assert indices.tolist() == [7, 3, 4, 5, 6]
    assert last.tolist() == [1, 1, 16]
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_start_up_check_passes_a_kernel_that_keeps_flashinfers_contract(stand_in, dtype):
    stand_in(ContractWrapper)
    assert check(9, (16, 3, 64), dtype, torch.device("cpu")) is None


def test_the_start_up_check_catches_a_kernel_that_reads_past_the_context(stand_in):
    stand_in(WholePagesWrapper)
    problem = check(9, (16, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert problem is not None and problem.startswith("differs from the eager gather")


def test_the_start_up_check_reports_an_api_it_does_not_know(stand_in):
    class OldWrapper(ContractWrapper):
        def plan(self, *args: object) -> None:  # positional arguments only, as before FlashInfer 0.2
            pass

    stand_in(OldWrapper)
    problem = check(9, (16, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert problem is not None and problem.startswith("TypeError") and "q_data_type" in problem


def test_a_worker_on_the_flashinfer_backend_plans_each_step_and_keeps_generates_output(stand_in):
    """The model runner's side of the backend, on the real model: one schedule per step, carried to
    every layer in the decode group; float32 greedy output equals ``generate``."""
    stand_in(ContractWrapper)
    source = resolve_model("SmolLM2-135M-Instruct")
    # transformers' classes: their attention goes through worker/attention/paged.py, with no Triton kernel for rotary.
    engine = build_engine(
        source, WorkerConfig(dtype="float32", device="cpu", model_impl="transformers", kv_cache_memory="64MiB")
    )
    runner = engine.runner
    backend = FlashInferBackend(torch.device("cpu"))
    backend.prepare(runner.kv_caches, runner.model.config.num_attention_heads)
    runner.inputs.backend = backend
    prompts = [
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
        [1, 4093, 198, 7306, 260, 2400, 282, 24546, 30, 2, 198, 1, 520, 9531, 198],
    ]
    for i, ids in enumerate(prompts):
        engine.add_request(
            NewRequest(f"r{i}", ids, 12, SamplingParams(temperature=0, min_tokens=12))
        )  # both rows to the end
    out: dict[str, list[int]] = {}
    steps = 0
    ContractWrapper.plans = ContractWrapper.runs = 0
    while engine.has_work():
        steps += 1
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    layers = runner.model.config.num_hidden_layers
    assert 0 < ContractWrapper.plans < steps, "one schedule per step with decode rows (the first step only prefills)"
    assert ContractWrapper.runs == ContractWrapper.plans * layers, "every layer runs the step's schedule"

    model = load_model(source, torch.float32, CACHE_DIR.env_default()).eval()
    with torch.inference_mode():
        expected = [
            model.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    assert [out["r0"], out["r1"]] == expected


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_decode.available(), reason="needs FlashInfer and a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_captured_schedule_replays_with_each_new_plan(dtype):
    """The CUDA-graph variant (worker/runner/cuda_graphs.py's use): captured once, then planned with other
    rows before each replay; every replay must read the new pages and lengths."""
    from worker.attention import DecodeGroup, EagerDecode

    rows, heads, kv_heads, head_dim, block_size, max_blocks = 4, 9, 3, 64, 16, 40
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    k_cache, v_cache = (
        torch.randn(
            rows * max_blocks + 1, block_size, kv_heads, head_dim, generator=generator, device=device, dtype=dtype
        )
        for _ in range(2)
    )
    query = torch.randn(rows, heads, head_dim, generator=generator, device=device, dtype=dtype)
    decode = FlashInferDecode(
        k_cache, heads, flashinfer_decode.make_workspace(device), rows=rows, max_blocks=max_blocks
    )
    scale = head_dim**-0.5

    def plan(lengths: list[int], seed: int) -> DecodeGroup:
        order = torch.randperm(rows * max_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        tables = [order[r * max_blocks : r * max_blocks + -(-n // block_size)] for r, n in enumerate(lengths)]
        decode.plan(tables, lengths)
        width = max(map(len, tables))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
        return DecodeGroup(0, rows, padded, torch.tensor(lengths, device=device), max(lengths))

    plan([1, 1, 1, 1], 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        decode(query, k_cache, v_cache, scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(query, k_cache, v_cache, scale)
    for seed, lengths in enumerate([[1, 17, 300, 64], [600, 1, 16, 129], [640, 640, 2, 33]], start=1):
        group = plan(lengths, seed)
        graph.replay()
        want = EagerDecode()(query, k_cache, v_cache, group, scale)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
