"""worker/attention/triton_decode.py against a pure-torch reference, and inside a captured CUDA graph.

On CUDA the kernel runs on the GPU in bf16 and float32; without CUDA it runs under Triton's
interpreter on CPU tensors (float32 only there: the interpreter's numpy has no bfloat16, and it is
slow, so the CPU cases stay short). Skipped where triton is not installed (CI).
"""

import os
from types import SimpleNamespace

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: its jit reads it at decoration

pytest.importorskip("triton")

from worker.attention import triton_decode  # noqa: E402


def _interpreter_scalars_for_numpy_24() -> None:
    """triton 3.6's interpreter calls int() on a 1-element array for a runtime loop bound, which numpy
    2.4 refuses (triton-lang/triton#9171, fixed upstream by squeezing it): do that here too."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def squeezed(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = squeezed


if not CUDA:
    _interpreter_scalars_for_numpy_24()

DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def reference(query, k_cache, v_cache, block_tables, lengths, scaling):
    """Gather each row's context, expand the KV heads, softmax in float32."""
    rows, heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.zeros(rows, heads, head_dim, dtype=torch.float32, device=query.device)
    for row in range(rows):
        length = int(lengths[row])
        if length == 0:
            continue
        blocks = block_tables[row, : -(-length // block_size)]
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].float().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", query[row].float(), k) * scaling
        out[row] = torch.einsum("ht,thd->hd", scores.softmax(-1), v)
    return out.to(query.dtype)


def make_case(lengths, heads, kv_heads, head_dim, block_size, dtype, pad_blocks=2, spare_blocks=4, seed=0):
    """Random caches with spare NaN-filled blocks, and shuffled block tables padded with block 0 (NaN too)."""
    gen = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lengths]
    max_blocks = max(per_row) + pad_blocks
    num_blocks = 1 + sum(per_row) + spare_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is the padding entry
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int64)
    used = 0
    for row, count in enumerate(per_row):
        tables[row, :count] = order[used : used + count]
        used += count
    for spare in [0, *order[used:]]:  # never-written blocks (0 pads the tables): read unmasked, they make NaN
        k_cache[spare] = float("nan")
        v_cache[spare] = float("nan")
    query = torch.randn(len(lengths), heads, head_dim, generator=gen)
    to = dict(device=DEVICE, dtype=dtype)
    return (
        query.to(**to),
        k_cache.to(**to),
        v_cache.to(**to),
        tables.to(DEVICE),
        torch.tensor(lengths, dtype=torch.int64, device=DEVICE),
    )


def check(lengths, heads, kv_heads, head_dim, block_size, dtype, splits, seed=0):
    query, k_cache, v_cache, tables, lens = make_case(lengths, heads, kv_heads, head_dim, block_size, dtype, seed=seed)
    scaling = head_dim**-0.5
    got = triton_decode.paged_decode_attention(query, k_cache, v_cache, tables, lens, scaling, splits=splits)
    want = reference(query, k_cache, v_cache, tables, lens, scaling)
    assert got.shape == query.shape and got.dtype == query.dtype
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# (lengths, heads, kv_heads, head_dim, block_size): lengths of 1, exact block multiples, partial blocks.
CASES = {
    "smollm2-1row": ([37], 9, 3, 64, 16),
    "smollm2-3rows": ([1, 16, 600], 9, 3, 64, 16),
    "llama-8rows": ([1, 5, 16, 17, 64, 100, 129, 250], 32, 8, 64, 16),
    "hd128-3rows": ([33, 1, 160], 8, 2, 128, 16),
    "block8": ([9, 1, 40], 9, 3, 64, 8),
    "block64": ([64, 1, 130], 32, 8, 64, 64),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference(case, splits, dtype):
    check(*case, dtype=dtype, splits=splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_more_splits_than_a_short_row_has_blocks(dtype):
    """Rows of 1 and 3 blocks under 7 splits: the empty splits must weigh nothing and make no NaN."""
    check([3, 40, 1], 9, 3, 64, 16, dtype, splits=7)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_default_splits(dtype):
    check([20, 300], 32, 8, 64, 16, dtype, splits=None)


def test_zero_length_row_gives_zeros():
    """Graph-padding rows of length 0 come out as zeros, not NaN, with and without splits."""
    query, k_cache, v_cache, tables, lens = make_case([0, 20], 9, 3, 64, 16, torch.float32)
    for splits in (1, 3):
        got = triton_decode.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, splits=splits)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        torch.testing.assert_close(
            got[1:], reference(query, k_cache, v_cache, tables, lens, 0.125)[1:], atol=1e-4, rtol=1e-4
        )


def test_num_splits():
    assert triton_decode.num_splits(1, 3) == 64  # 3 programs -> 88 splits for two waves, rounded down to a power of two
    assert triton_decode.num_splits(1, 8) == 32  # 33 -> 32
    assert triton_decode.num_splits(8, 3) == 8  # 11 -> 8
    assert triton_decode.num_splits(64, 8) == 1  # 512 programs already fill the GPU
    assert triton_decode.num_splits(0, 8) == 1
    assert {triton_decode.num_splits(rows, kv) for rows in range(1, 300) for kv in (1, 2, 3, 8)} <= {
        1,
        2,
        4,
        8,
        16,
        32,
        64,
    }


def test_warm_up_runs_every_split_count():
    _, k_cache, v_cache, _, _ = make_case([5], 9, 3, 64, 16, torch.float32)
    triton_decode.warm_up(k_cache, v_cache, heads=9)


def test_available():
    assert triton_decode.available()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_batch_on_gpu(dtype):
    lengths = [1 + (i * 97) % 2000 for i in range(33)]
    check(lengths, 32, 8, 64, 16, dtype, splits=None)
    check(lengths, 9, 3, 64, 16, dtype, splits=3, seed=1)
    check(lengths[:9], 8, 2, 128, 32, dtype, splits=16, seed=2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_replay_with_new_lengths_and_tables(dtype):
    """Captured once; new lengths and block tables copied into the static inputs must be honoured."""
    rows, heads, kv_heads, head_dim, block_size = 4, 9, 3, 64, 16
    first = make_case(
        [1, 17, 300, 64], heads, kv_heads, head_dim, block_size, dtype, pad_blocks=30, spare_blocks=30, seed=3
    )
    query, k_cache, v_cache, tables, lens = (t.clone() for t in first)
    splits = triton_decode.num_splits(rows, kv_heads)
    assert splits > 1
    scaling = head_dim**-0.5
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        triton_decode.paged_decode_attention(query, k_cache, v_cache, tables, lens, scaling)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.paged_decode_attention(query, k_cache, v_cache, tables, lens, scaling)
    graph.replay()
    torch.testing.assert_close(
        out.float(), reference(*first, scaling).float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
    )

    # Same shapes, other contexts: longer, shorter, one row emptied to length 1, other blocks.
    second = make_case([500, 1, 16, 129], heads, kv_heads, head_dim, block_size, dtype, pad_blocks=0, seed=4)
    new_query, new_k, new_v, new_tables, new_lens = second
    assert new_tables.shape[1] <= tables.shape[1] and new_k.shape[0] <= k_cache.shape[0]
    query.copy_(new_query)
    k_cache[: new_k.shape[0]].copy_(new_k)
    v_cache[: new_v.shape[0]].copy_(new_v)
    tables.zero_()
    tables[:, : new_tables.shape[1]].copy_(new_tables)
    lens.copy_(new_lens)
    graph.replay()
    want = reference(query, k_cache, v_cache, tables, lens, scaling)
    torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_cache_matches_torch(dtype):
    """worker/attention/triton_rope.py: rotated queries out, rotated keys and the values in their cache slots, nothing else written."""
    from worker.attention import triton_rope

    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, head_dim, blocks, block_size = 5, 9, 3, 64, 6, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(DEVICE, dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(DEVICE, dtype)
    slots = torch.tensor([3, 40, 17, 90, 64], device=DEVICE)
    k_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    k_expected, v_expected = k_cache.clone().view(-1, kv_heads, head_dim), v_cache.clone().view(-1, kv_heads, head_dim)
    q = triton_rope.rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, heads, kv_heads)

    x = qkv.float().view(tokens, heads + 2 * kv_heads, head_dim)
    rotated = (
        x[:, : heads + kv_heads] * cos.float()[:, None] + _rotate_half(x[:, : heads + kv_heads]) * sin.float()[:, None]
    )
    k_expected[slots] = rotated[:, heads:].to(dtype)
    v_expected[slots] = x[:, heads + kv_heads :].to(dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(q.float(), rotated[:, :heads], atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.view(-1, kv_heads, head_dim).float(), k_expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(v_cache.view(-1, kv_heads, head_dim), v_expected, atol=0, rtol=0)


def test_the_fused_decode_step_matches_the_torch_path(monkeypatch):
    """LlamaForward with the Triton decode path (rotary + cache write, then paged attention: the Triton
    kernel, or FlashInfer's schedule, here its stand-in) gives the logits and cache contents of its
    torch path (rotary in torch, index_copy_, eager attention)."""
    from transformers import LlamaForCausalLM

    from tests.worker.families import family_config
    from tests.worker.test_flashinfer_attention import ContractWrapper
    from worker.attention import AttentionMetadata, DecodeGroup, EagerDecode, flashinfer_decode
    from worker.models.llama import LlamaForward

    # The stand-in also on a GPU: the path here is float32, which FlashInfer's decode kernels do not take.
    monkeypatch.setattr(
        flashinfer_decode, "flashinfer", SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=ContractWrapper)
    )

    torch.manual_seed(0)
    config = family_config("llama", dict(vocab_size=100))
    forward = LlamaForward(LlamaForCausalLM(config).eval().to(DEVICE))
    lengths = [5, 17, 30]
    tables = torch.tensor([[1, 0], [2, 3], [4, 5]], device=DEVICE)
    positions = torch.tensor([n - 1 for n in lengths], device=DEVICE)
    slots = torch.tensor(
        [int(tables[r, p // 16]) * 16 + p % 16 for r, p in enumerate(positions.tolist())], device=DEVICE
    )
    caches = [(torch.randn(6, 16, 2, 16, device=DEVICE), torch.randn(6, 16, 2, 16, device=DEVICE)) for _ in range(2)]
    ids = torch.tensor([[7, 11, 13]], device=DEVICE)
    results = {}
    for backend in ("triton", "flashinfer", "eager"):
        kv = [(k.clone(), v.clone()) for k, v in caches]
        group = DecodeGroup(0, 3, tables, torch.tensor(lengths, device=DEVICE), 32)
        if backend == "flashinfer":
            group.planned = flashinfer_decode.FlashInferDecode(
                kv[0][0], 4, torch.zeros(16, dtype=torch.uint8, device=DEVICE)
            )
            group.planned.plan(tables.tolist(), lengths)
        chosen = {"triton": triton_decode.TritonDecode(), "eager": EagerDecode()}.get(
            backend
        ) or flashinfer_decode.FlashInferBackend(DEVICE)
        meta = AttentionMetadata(kv, slots, 3, [group], [], chosen)
        results[backend] = (forward(ids, positions[None], meta, torch.arange(3, device=DEVICE)), kv)
    torch_logits, torch_kv = results["eager"]
    for backend in ("triton", "flashinfer"):
        fused_logits, fused_kv = results[backend]
        torch.testing.assert_close(fused_logits, torch_logits, atol=1e-4, rtol=1e-4)
        for (fk, fv), (tk, tv) in zip(fused_kv, torch_kv):
            torch.testing.assert_close(fk, tk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                fv, tv, atol=1e-5, rtol=1e-5
            )  # layer 2 sees layer 1's attention, summed in another order
