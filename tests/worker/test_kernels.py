"""The C++ kernels (worker/kernels) against plain torch arithmetic, once per variant this CPU executes
(the ``ops`` fixture, tests/worker/conftest.py), and the fused decode step against the torch forward
of the same model."""

import pytest
import torch

from worker import cpu, kernels
from worker.quantization import pack_int8, quantize_int8

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"C++ kernels did not build: {kernels.unavailable_reason()}")


def reference_attention(q, k_cache, v_cache, tables, lengths, scale):
    """Gather each row's context and attend in float32, KV heads repeated for their query heads."""
    rows, heads, _ = q.shape
    kv_heads = k_cache.shape[2]
    out = []
    for r in range(rows):
        n = int(lengths[r])
        k = k_cache[tables[r]].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, 1)
        v = v_cache[tables[r]].flatten(0, 1)[:n].float().repeat_interleave(heads // kv_heads, 1)
        weights = (torch.einsum("hd,thd->ht", q[r].float(), k) * scale).softmax(-1)
        out.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows, heads, kv_heads, head_dim, lengths, block_size",
    [
        (1, 9, 3, 64, [1], 16),
        (2, 4, 2, 48, [40, 7], 16),  # a head_dim that is not a multiple of 32
        (1, 9, 3, 64, [4099], 16),  # long context: split across threads, a partial last block
        (3, 8, 8, 32, [17, 5, 300], 16),  # no GQA, rows of different lengths
        (20, 16, 2, 128, [33] * 10 + [130] * 10, 16),
        (2, 9, 3, 64, [1001, 37], 8),  # tiles of 16 positions span two blocks
        (2, 9, 3, 64, [1001, 37], 32),  # two tiles a block
    ],
)
def test_paged_decode_attention_matches_gathered_attention(
    ops, dtype, rows, heads, kv_heads, head_dim, lengths, block_size
):
    torch.manual_seed(0)
    num_blocks = 700
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype)
    max_blocks = max(-(-n // block_size) for n in lengths)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in range(rows)])
    lengths_t = torch.tensor(lengths)
    q = torch.randn(rows, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, lengths_t, scale)
    want = reference_attention(q, k_cache, v_cache, tables, lengths_t, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("weights", ["int8", "bfloat16", "float32"])
def test_linear_matches_torch(ops, rows, weights):
    torch.manual_seed(rows)
    w = torch.randn(200, 72) * 0.1  # 72: a tail past the last full 16-wide vector
    x = torch.randn(rows, 72).bfloat16()
    bias = torch.randn(200)
    if weights == "int8":
        q, scale = quantize_int8(w)
        got = ops.linear(x, q, scale, bias)
        want = x.float() @ (q.float() * scale[:, :1]).T + bias
    else:
        wt = w.to(getattr(torch, weights))
        got = ops.linear(x, wt, None, bias)
        want = x.float() @ wt.float().T + bias
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int8_quantization_error_is_bounded_by_half_a_step():
    w = torch.randn(64, 256)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert ((q.float() * scale[:, :1] - w).abs() <= scale[:, :1] / 2 + 1e-6).all()
    assert torch.equal(scale[:, 1:], q.view(64, 4, 64).sum(-1).float())  # weight sums per group of 64


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 13])
@pytest.mark.parametrize("layout", ["rows", "packed"])
def test_int8_with_int8_activations_stays_within_activation_rounding(ops, rows, layout):
    """K a multiple of 64: the int8 paths quantize activations per group of 64; the result is the
    int8-weight product up to that rounding (half a step of max|x|/127 per input). ``packed``: the
    block layout (6 blocks of 16 outputs: tiles of 4 and 2 blocks, or 2 and single ones), on every
    variant; ``rows``: VNNI on avx512, float loops elsewhere."""
    torch.manual_seed(rows)
    w = torch.randn(96, 192) * 0.1
    x = torch.randn(rows, 192)
    q, scale = quantize_int8(w)
    dense = q.float() * scale[:, :1]
    weight, meta = pack_int8(q, scale) if layout == "packed" else (q, scale)
    assert weight.dim() == (4 if layout == "packed" else 2)
    got = ops.linear(x, weight, meta, None)
    step = x.view(rows, 3, 64).abs().amax(-1, keepdim=True) / 127
    bound = (step.unsqueeze(1) / 2 * dense.view(96, 3, 64).abs().unsqueeze(0)).sum((-1, -2))  # [rows, 96]
    assert ((got - x @ dense.T).abs() <= bound + 1e-4).all()
    if layout == "packed" or ops.variant() == "avx512":
        assert (got - x @ dense.T).abs().max() > 0  # activations really were quantized (the int8 path ran)


def test_packed_int8_adds_the_bias_and_keeps_unpackable_shapes(ops):
    torch.manual_seed(0)
    q, scale = quantize_int8(torch.randn(48, 128) * 0.1)
    weight, meta = pack_int8(q, scale)
    x, bias = torch.randn(2, 128), torch.randn(48)
    torch.testing.assert_close(ops.linear(x, weight, meta, bias), ops.linear(x, weight, meta, None) + bias)
    odd = quantize_int8(torch.randn(40, 128))  # 40 rows: not whole blocks of 16
    assert pack_int8(*odd)[0] is odd[0]


def test_fused_decode_step_matches_the_torch_forward_of_the_same_weights(monkeypatch):
    """In float32 with the model's own weights (no quantization) the one-call decode step gives the
    torch path's greedy tokens: same norms, rotary, cache writes and attention, only the summation
    order differs. (Float32 normally keeps the torch path; the test switches the kernel on.)"""
    from common.model_source import resolve_model
    from common.protocol import NewRequest, SamplingParams
    from worker.build import build_engine
    from worker.config import WorkerConfig
    from worker.runner import model_runner, paths

    prompts = [
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
        [1, 4093, 198, 31530, 253, 1403, 21881, 563, 260, 5304, 30, 2, 198, 1, 520, 9531, 198],
    ]

    def force_kernel(choice: str, *args: object) -> tuple[str, bool]:
        return "none", True

    def run(fast_rows: int) -> tuple[dict[str, list[int]], int]:
        monkeypatch.setattr(paths, "FAST_DECODE_MAX_ROWS", fast_rows)
        engine = build_engine(
            resolve_model("SmolLM2-135M-Instruct"), WorkerConfig(dtype="float32", kv_cache_memory="64MiB")
        )
        calls = 0
        decode = engine.runner.paths.fused

        class Counted:
            any_batch = decode.any_batch

            def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
                nonlocal calls
                calls += 1
                return decode(*args, **kwargs)

        counted = Counted()

        engine.runner.paths.fused = counted
        for i, ids in enumerate(prompts):
            engine.add_request(NewRequest(f"r{i}", ids, 24, SamplingParams(temperature=0)))
        out: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step().outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out, calls

    monkeypatch.setattr(model_runner, "pick_decode_path", force_kernel)
    fused, fused_calls = run(fast_rows=4)
    plain, plain_calls = run(fast_rows=0)
    assert fused_calls >= 20 and plain_calls == 0
    assert fused == plain


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_q4_linear_matches_its_dequantized_weights(ops, rows):
    from worker.quantization import dequantize_q4, quantize_q4

    torch.manual_seed(rows)
    w = torch.randn(72, 96) * 0.1
    packed, dm = quantize_q4(w)
    assert packed.shape == (72, 48) and packed.dtype == torch.uint8 and dm.shape == (72, 3, 2)
    dense = dequantize_q4(packed, dm)
    step = dm[..., 0].float().repeat_interleave(32, dim=1)
    assert ((dense - w).abs() <= step / 2 + 1e-3).all()  # within half a step (plus float16 rounding)
    x = torch.randn(rows, 96).bfloat16()
    torch.testing.assert_close(ops.linear(x, packed, dm, None), x.float() @ dense.T, atol=1e-4, rtol=1e-4)


def test_q4_reproduces_a_q4_1_grid_exactly():
    """Weights already on a 4-bit grid per group of 32 (a Q4_1 GGUF, de-quantized) come back unchanged."""
    from worker.quantization import dequantize_q4, quantize_q4

    torch.manual_seed(0)
    d = (torch.rand(16, 4, 1) * 0.01 + 0.001).half().float()
    m = (torch.randn(16, 4, 1) * 0.05).half().float()
    q = torch.randint(0, 16, (16, 4, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 spans each group's min and max
    w = (q * d + m).view(16, 128)
    torch.testing.assert_close(dequantize_q4(*quantize_q4(w)), w, atol=1e-6, rtol=0)


def test_q4_reproduces_a_q4_0_grid():
    """A Q4_0 GGUF's groups (w = d * (q - 8), the largest magnitude at q = 0, d of either sign) come
    back to within float16's rounding of the grid's minimum (7 d is not always a float16), not
    rounded again onto Q4_1's grid (up to half a step off)."""
    from worker.quantization import dequantize_q4, quantize_q4

    torch.manual_seed(0)
    d = ((torch.rand(16, 4, 1) * 0.01 + 0.001) * torch.where(torch.rand(16, 4, 1) < 0.5, -1, 1)).half().float()
    q = torch.randint(1, 15, (16, 4, 32)).float()  # the other extreme (q = 15) not reached: Q4_1's grid misses it
    q[..., 0] = 0
    w = (d * (q - 8)).view(16, 128)
    torch.testing.assert_close(dequantize_q4(*quantize_q4(w)), w, atol=5e-5, rtol=0)


def test_q4_reproduces_q4_k_groups_whose_extreme_levels_are_unused_and_tells_off_grid_weights():
    """A Q4_K group (w = d * sc * q - dmin * m, 6-bit sc and m per 32) need not use q = 0 or 15:
    neither Q4_1's grid (min to max in 15 steps) nor Q4_0's fits it, the narrower span does. Float
    weights on no grid report an error of about half a step (the layout keeps such a matrix of a
    4-bit file at int8)."""
    from worker.quantization import OFF_GRID, dequantize_q4, fit_q4

    torch.manual_seed(0)
    d = (torch.rand(16, 4, 1) * 0.01 + 0.001).half().float() * torch.randint(20, 64, (16, 4, 1))
    m = -(torch.rand(16, 4, 1) * 12 * d).half().float()  # a group's minimum, a few steps below zero
    q = torch.randint(2, 13, (16, 4, 32)).float()  # levels 2..12 used: a span of at most 10 steps
    q[..., 0], q[..., 1] = 2, 12
    w = (q * d + m).view(16, 128)
    packed, dm, worst = fit_q4(w)
    off = (dequantize_q4(packed, dm) - w).view(16, 4, 32).abs().amax(dim=-1) / d.squeeze(-1)
    assert worst < 0.02 and off.max() < 0.02, "back on their grid, to float16's rounding of step and minimum"
    assert fit_q4(torch.randn(16, 128))[2] > OFF_GRID


def test_the_tests_q4_k_writer_is_what_gguf_reads():
    """tests/worker/families.py writes Q4_K blocks itself (gguf cannot): gguf's de-quantizer reads
    them back within half a 4-bit step of the weights, on at most 16 levels per group of 32."""
    import gguf
    import numpy as np

    from tests.worker.families import quantize_q4_k

    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32) * 0.05
    y = gguf.quants.dequantize(quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K)
    groups = x.reshape(-1, 32)
    assert (
        np.abs(y - x).reshape(-1, 32).max(axis=1).max()
        <= 0.55 * (groups.max(1) - np.minimum(groups.min(1), 0)).max() / 15
    )
    assert max(len(np.unique(g)) for g in y.reshape(-1, 32)) <= 16


@pytest.mark.parametrize("rows", [1, 2, 4, 6])
def test_q4_with_int8_activations_stays_within_activation_rounding(ops, rows):
    """K a multiple of 64: avx512's VNNI path multiplies row-major nibbles by int8 activations (per
    group of 64); other variants' float loops are within the same bound."""
    from worker.quantization import dequantize_q4, quantize_q4

    torch.manual_seed(rows)
    w = torch.randn(40, 192) * 0.1
    x = torch.randn(rows, 192)
    dense = dequantize_q4(*quantize_q4(w))
    got = ops.linear(x, *quantize_q4(w), None)
    step = x.view(rows, 3, 64).abs().amax(-1, keepdim=True) / 127
    bound = (step.unsqueeze(1) / 2 * dense.view(40, 3, 64).abs().unsqueeze(0)).sum((-1, -2))
    assert ((got - x @ dense.T).abs() <= bound + 1e-4).all()
    if ops.variant() == "avx512":
        assert (got - x @ dense.T).abs().max() > 0


def test_fused_temperature_sampling_inverts_the_same_cdf_as_torch(ops):
    """ops.sample_temperature at uniform u picks the token torch's cumsum/searchsorted
    picks (up to rounding at a boundary), never a masked token, and follows softmax(x / T)."""
    torch.manual_seed(0)
    rows, vocab = 3, 49152
    x = torch.randn(rows, vocab) * 4
    x[:, ::3] = float("-inf")  # masked (a grammar, a logit bias): never picked
    temperature = torch.tensor([0.7, 1.0, 1.6])
    agree = total = 0
    for _ in range(100):
        u = torch.rand(rows)
        got = ops.sample_temperature(x, temperature, u)
        assert (got % 3 != 0).all()
        cdf = ((x - x.amax(-1, keepdim=True)) / temperature.unsqueeze(1)).exp().cumsum(-1)
        want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
        agree += int((got == want).sum())
        total += rows
    assert agree >= 0.98 * total
    # The frequencies follow the distribution: a 4-token vocabulary, 4,000 draws.
    small = torch.tensor([[2.0, 1.0, 0.0, float("-inf")]])
    draws = torch.stack([ops.sample_temperature(small, torch.tensor([1.0]), torch.rand(1)) for _ in range(4000)])
    freq = torch.bincount(draws.flatten(), minlength=4).float() / 4000
    torch.testing.assert_close(freq, torch.softmax(small[0], -1), atol=0.03, rtol=0)


def test_argmax_rows_is_torch_argmax(ops):
    """Greedy's pick from the kernels is torch.argmax's index: the first of tied maxima, a NaN before
    anything, infinities, and a vocabulary that is no multiple of 16."""
    torch.manual_seed(0)
    for vocab in (49152, 1000, 7):
        x = torch.randn(6, vocab).round(decimals=1)  # ties
        x[1, ::3] = float("-inf")
        x[2, vocab // 2] = float("inf")
        x[2, -1] = float("inf")
        x[3, vocab - 1] = float("nan")
        x[3, 0] = float("inf")
        x[4] = float("-inf")
        x[5, vocab // 3] = x[5].max() + 1  # one clear winner
        assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1)), vocab


@pytest.mark.parametrize(
    "quantization, intermediate, any_batch",
    [("int8", 128, True), ("int8", 40, False), ("int8", 96, False), ("q4", 128, True), ("q4", 96, True)],
)
def test_any_batch_decode_needs_every_projection_packed(quantization, intermediate, any_batch):
    """An MLP width a packer cannot block (down_proj's K: int8 packs groups of 64, q4 of 32) stays
    in the row layout, whose matrix-vector loops only suit a few rows: such a model keeps large
    batches on the torch path."""
    from transformers import LlamaForCausalLM

    from tests.worker.families import family_config
    from worker.models.fused_decode import FusedDecode

    config = family_config("llama", dict(intermediate_size=intermediate, num_hidden_layers=1))
    fused = FusedDecode(LlamaForCausalLM(config).eval(), quantization=quantization)
    assert fused.any_batch is any_batch
    assert fused.weights[2].dim() == 4  # the shapes that do block are packed either way (slot 2: QKV)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])
def test_packed_q4_stays_within_activation_rounding(ops, rows):
    """The packed q4 GEMM (any rows, activations int8 per group of 32) against its de-quantized weights."""
    from worker.quantization import dequantize_q4, pack_q4, quantize_q4

    torch.manual_seed(rows)
    w = torch.randn(80, 160) * 0.1
    x, bias = torch.randn(rows, 160), torch.randn(80)
    dense = dequantize_q4(*quantize_q4(w))
    weight, meta = pack_q4(*quantize_q4(w))
    assert weight.shape == (5, 20, 16, 4) and meta.shape == (5, 5, 2, 16)
    got = ops.linear(x, weight, meta, bias)
    step = x.view(rows, 5, 32).abs().amax(-1, keepdim=True) / 127
    bound = (step.unsqueeze(1) / 2 * dense.view(80, 5, 32).abs().unsqueeze(0)).sum((-1, -2))  # [rows, 80]
    exact = x @ dense.T + bias
    assert ((got - exact).abs() <= bound + 1e-4).all()
    assert (got - exact).abs().max() > 0  # activations really were quantized (the VNNI path ran)
    odd = quantize_q4(torch.randn(40, 64))  # 40 rows: not whole blocks of 16
    assert pack_q4(*odd)[0] is odd[0]


def test_auto_quantization_recognises_weights_on_a_4bit_grid():
    """A model whose projections were de-quantized from 4 bits (at most 16 values per group of 32)
    is told apart from one with ordinary weights, in bf16 as in float32."""
    from worker.quantization import dequantize_q4, on_4bit_grid, quantize_q4

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(96, 32))  # shapes only: never run
    assert not on_4bit_grid(model)
    with torch.no_grad():
        for layer in model:
            layer.weight.copy_(dequantize_q4(*quantize_q4(layer.weight.data)))
    assert on_4bit_grid(model) and on_4bit_grid(model.to(torch.bfloat16))
    assert not on_4bit_grid(torch.nn.Sequential(torch.nn.Linear(40, 8)))  # inputs not in groups of 32


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_decode_weights_are_made_once_then_read_from_the_cache(quantization, tmp_path, monkeypatch):
    """The second worker start of a model reads the decode kernel's weights from the conversion
    cache, equal to the ones it made; a folder from an older layout of the same kind is removed."""
    from transformers import Qwen2ForCausalLM

    from tests.worker.families import family_config
    from worker.models import fused_decode

    config = family_config("qwen2", {})  # QKV bias: every kind of tensor the decode weights hold
    model = Qwen2ForCausalLM(config).eval()
    stale = tmp_path / f"{quantization}-packed-000000000000"
    stale.mkdir()
    made = fused_decode.FusedDecode(model, quantization=quantization, cache=tmp_path)
    assert not stale.exists()
    (folder,) = tmp_path.iterdir()
    assert (folder / "tensors.safetensors").is_file()

    def fail(*_: object) -> None:
        raise AssertionError("the decode weights were made again")

    monkeypatch.setattr(fused_decode, "_layout", fail)
    read = fused_decode.FusedDecode(model, quantization=quantization, cache=tmp_path)
    slots = fused_decode.SLOTS
    assert [t is None for t in made.weights] == [t is None for t in read.weights]
    assert (
        read.weights[slots.index("qkv_bias")] is not None
        and read.weights[len(slots) + slots.index("qkv_bias")] is not None
    )
    for i, (a, b) in enumerate(zip(made.weights + [made.lm_head], read.weights + [read.lm_head])):
        assert a is None or torch.equal(a, b), i


def test_a_damaged_tensor_cache_is_rebuilt_and_replaced(tmp_path):
    from worker.loader import cached_tensors

    folder = tmp_path / "q4-packed-0"
    folder.mkdir()
    (folder / "tensors.safetensors").write_bytes(b"not a safetensors file")
    want = {"w": torch.arange(6.0).view(2, 3)}
    assert torch.equal(cached_tensors(folder, lambda: want)["w"], want["w"])
    assert torch.equal(cached_tensors(folder, lambda: {})["w"], want["w"])  # the second read is the new file


def test_the_build_folder_is_one_per_source_and_variant_and_holds_its_own_source(tmp_path, monkeypatch):
    """Checkouts with the same source share a build (its source copied to one path, so nothing
    rebuilds after another checkout); each variant has its own, named by its flags, never by the
    build machine's CPU (no -march=native: a cache moved to another CPU stays valid)."""
    from worker.kernels import compile as kernel_compile

    monkeypatch.setenv("LLMPOOL_KERNEL_DIR", str(tmp_path))
    avx2, portable = (next(v for v in cpu.VARIANTS if v.arch == "x86_64" and v.name == n) for n in ("avx2", "portable"))
    here = kernel_compile.build_dir(avx2)
    assert here == kernel_compile.build_dir(avx2) and here.parent == tmp_path
    assert kernel_compile.build_dir(portable) != here
    assert all("native" not in flag for v in cpu.VARIANTS for flag in kernel_compile.flags(v))
    monkeypatch.setattr(cpu, "features", lambda: frozenset({"sse2"}))
    assert kernel_compile.build_dir(avx2) == here  # another CPU, the same build
