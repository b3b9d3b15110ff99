"""The kernel variants against each other (worker/cpu.py, worker/kernels): the packed int8 and q4
GEMMs give the same bits on avx2, avxvnni and avx512, and on neon and neon_i8mm (exact integer sums,
whether by sdot or by smmla's row pairs, the same float folds lane by lane), every variant stays within
float rounding of the portable one, and a whole quantized decode step agrees across variants. The
variant choice and its cap (LLMPOOL_CPU_ISA) are checked here too."""

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker import cpu, kernels
from worker.quantization import pack_int8, pack_q4, quantize_int8, quantize_q4

pytestmark = pytest.mark.skipif(not kernels.load(), reason=f"C++ kernels did not build: {kernels.unavailable_reason()}")
RUNNABLE = {v.name: v for v in cpu.runnable()}
# Per architecture, the SIMD variants: integer dot products of their own, float folds in one order.
SIMD = {"x86_64": ("avx512", "avxvnni", "avx2"), "aarch64": ("neon_i8mm", "neon")}


def assert_simd_equal(got: dict[str, torch.Tensor]) -> None:
    """The SIMD variants this CPU runs give the same bits (avx2's maddubs pairs, avxvnni's and avx512's
    vpdpbusd; neon's sdot and neon_i8mm's smmla row pairs: the same exact integer sums)."""
    simd = [name for name in SIMD.get(cpu.arch(), ()) if name in got]
    for name in simd[1:]:
        assert torch.equal(got[name], got[simd[0]]), (name, simd[0])


def every_variant(call):
    return {name: call(kernels.variant_ops(variant)) for name, variant in RUNNABLE.items()}


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 17])
@pytest.mark.parametrize("weights", ["int8", "q4"])
def test_packed_gemms_agree_across_variants(rows, weights):
    torch.manual_seed(rows)
    w, x, bias = torch.randn(96, 256) * 0.1, torch.randn(rows, 256), torch.randn(96)
    weight, meta = pack_int8(*quantize_int8(w)) if weights == "int8" else pack_q4(*quantize_q4(w))
    assert weight.dim() == 4
    got = every_variant(lambda ops: ops.linear(x, weight, meta, bias))
    for name, out in got.items():
        torch.testing.assert_close(out, got["portable"], atol=1e-5, rtol=1e-5, msg=name)
    assert_simd_equal(got)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_a_quantized_decode_step_agrees_across_variants(quantization):
    """A tiny Llama's step, each prompt position as a row over a paged bf16 cache, on every variant:
    each position's top token in transformers' top 5 (vLLM's closeness rule, as
    test_fused_families.py holds the chosen variant to) and logits near the portable variant's.
    Activations are rounded to int8 inside the step, so a last-bit difference upstream (portable's
    unfused multiply-adds) can move a rounding: near, not equal; on avx2 and avx512 the step is equal."""
    from tests.worker.test_fused_families import PROMPT, SIZES, fused_logits, tiny
    from worker.models.fused_decode import FusedDecode

    model = tiny("llama")
    fused = FusedDecode(model, quantization)
    assert fused.packed
    ids = torch.randint(1, SIZES["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        top5 = model(ids[None]).logits[0].float().topk(5, dim=-1).indices

    def step(ops):
        fused.ops = ops
        return fused_logits(model, fused, ids, torch.bfloat16)

    got = every_variant(step)
    for name, logits in got.items():
        close = (top5 == logits.argmax(-1, keepdim=True)).any(-1).float().mean().item()
        assert close >= (1.0 if quantization == "int8" else 0.95), (name, close)
        torch.testing.assert_close(logits, got["portable"], atol=3e-2, rtol=3e-2, msg=name)
    assert_simd_equal(got)


def test_the_variant_is_the_best_the_cpu_runs_under_the_cap(monkeypatch):
    """No cap: the first runnable variant; a cap takes the best at or under it; the portable variant
    runs anywhere; a cap naming another architecture's set is refused in one sentence."""
    monkeypatch.delenv(cpu.CAP_VARIABLE, raising=False)
    assert cpu.chosen() == cpu.runnable()[0]
    monkeypatch.setenv(cpu.CAP_VARIABLE, "portable")
    assert cpu.chosen().name == "portable"
    if cpu.arch() == "x86_64":
        monkeypatch.setattr(cpu, "features", lambda: frozenset({"avx2", "fma", "f16c", "bmi2"}))
        monkeypatch.setenv(cpu.CAP_VARIABLE, "avx512")  # a cap above the CPU: its best
        assert cpu.chosen().name == "avx2"
        monkeypatch.setattr(cpu, "features", lambda: frozenset({"avx2", "fma", "f16c", "bmi2", "avx_vnni"}))
        assert cpu.chosen().name == "avxvnni"  # Alder Lake: AVX-VNNI without AVX-512
        monkeypatch.setenv(cpu.CAP_VARIABLE, "avx2")  # the held-out check's cap: plain avx2 below it
        assert cpu.chosen().name == "avx2"
        monkeypatch.setattr(cpu, "features", lambda: frozenset({"sse2"}))
        monkeypatch.delenv(cpu.CAP_VARIABLE)
        assert cpu.chosen().name == "portable"
        monkeypatch.setenv(cpu.CAP_VARIABLE, "neon")
        with pytest.raises(ValueError, match="LLMPOOL_CPU_ISA='neon' is not an instruction set"):
            cpu.chosen()
    # aarch64's choice, whatever this machine is: i8mm (Graviton 3/4, Apple M2+) takes neon_i8mm,
    # the dot product alone (Graviton 2, M1) neon, a cap of neon holds an i8mm CPU to it.
    monkeypatch.delenv(cpu.CAP_VARIABLE, raising=False)
    monkeypatch.setattr(cpu, "arch", lambda: "aarch64")
    monkeypatch.setattr(cpu, "features", lambda: frozenset({"fp", "asimd", "asimddp", "i8mm", "bf16", "sve"}))
    assert [v.name for v in cpu.runnable()] == ["neon_i8mm", "neon", "portable"]
    assert cpu.chosen().name == "neon_i8mm"
    monkeypatch.setenv(cpu.CAP_VARIABLE, "neon")
    assert cpu.chosen().name == "neon"
    monkeypatch.delenv(cpu.CAP_VARIABLE)
    monkeypatch.setattr(cpu, "features", lambda: frozenset({"fp", "asimd", "asimddp"}))
    assert cpu.chosen().name == "neon"


def test_aarch64_linux_reads_the_capabilities_linux_grants_from_the_auxiliary_vector(tmp_path, monkeypatch):
    """An arm64 container on an x86 host (qemu-user, binfmt_misc) shows the host's /proc/cpuinfo; the
    auxiliary vector holds the emulated CPU's capabilities, as on real ARM: AT_HWCAP's asimd (1),
    asimddp (20) and sve (22), AT_HWCAP2's sve2 (1), i8mm (13) and bf16 (14)."""
    monkeypatch.setattr(cpu, "arch", lambda: "aarch64")
    auxv = tmp_path / "auxv"
    graviton2 = 1 << 0 | 1 << 1 | 1 << 20
    auxv.write_bytes(struct.pack("=6Q", 6, 4096, 16, graviton2, 0, 0))  # AT_PAGESZ, AT_HWCAP, AT_NULL
    assert cpu.arm_hwcaps(str(auxv)) == {"fp", "asimd", "asimddp"}
    assert cpu.runnable(cpu.arm_hwcaps(str(auxv)))[0].name == "neon"
    graviton3 = struct.pack("=6Q", 16, graviton2 | 1 << 22, 26, 1 << 1 | 1 << 13 | 1 << 14, 0, 0)
    auxv.write_bytes(graviton3)
    assert cpu.arm_hwcaps(str(auxv)) == {"fp", "asimd", "asimddp", "sve", "sve2", "i8mm", "bf16"}
    assert cpu.runnable(cpu.arm_hwcaps(str(auxv)))[0].name == "neon_i8mm"
    auxv.write_bytes(struct.pack("=4Q", 6, 4096, 0, 0))  # no AT_HWCAP: /proc/cpuinfo decides
    assert cpu.arm_hwcaps(str(auxv)) is None
    assert cpu.arm_hwcaps(str(tmp_path / "absent")) is None


@pytest.mark.skipif(cpu.arch() != "x86_64" or not Path("/proc/cpuinfo").exists(), reason="x86-64 Linux")
def test_x86_64_asks_the_cpu_what_it_executes_and_agrees_with_linux():
    """cpuid and XCR0, asked from Python (as ggml, ATen and numpy ask them), give every flag the
    variants and the bf16 default turn on exactly as this machine's /proc/cpuinfo lists it."""
    asked = cpu.x86_flags()
    assert asked is not None, "no executable page for the cpuid stub"
    listed = cpu.cpuinfo_flags()
    assert listed is not None
    for flag in set().union(*(v.needs for v in cpu.VARIANTS if v.arch == "x86_64")) | {"avx512_bf16"}:
        assert (flag in asked) == (flag in listed), flag


QEMU_X86 = shutil.which("qemu-x86_64-static") or shutil.which("qemu-x86_64")
EMULATED = """
import json, sys
from worker import cpu
report = {"chosen": cpu.chosen().name, "features": sorted(cpu.features()), "line": cpu.describe()}
if sys.argv[1] != "-":
    import torch
    from tests.worker.test_fused_families import fused_logits, tiny
    from worker import kernels
    from worker.models.fused_decode import FusedDecode
    assert kernels.load(), kernels.unavailable_reason()
    state, ids = torch.load(sys.argv[1])
    model = tiny("llama")
    model.load_state_dict(state)
    fused = FusedDecode(model, "q4")
    fused.ops = kernels.ops()
    torch.save(fused_logits(model, fused, ids, torch.bfloat16), sys.argv[2])
    report["active"] = kernels.active().name
print(json.dumps(report))
"""


def emulated(cpu_model: str, *args: str) -> dict:
    """EMULATED's report from this Python under qemu-user's ``cpu_model``, with no cap set."""
    env = {
        k: v for k, v in os.environ.items() if k not in (cpu.CAP_VARIABLE, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    command = [QEMU_X86, "-cpu", cpu_model, sys.executable, "-c", EMULATED, *(args or ["-"])]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(
    cpu.arch() != "x86_64" or QEMU_X86 is None or "avx2" not in RUNNABLE,
    reason="x86-64 with AVX2 and qemu-user (Debian's qemu-user-static: scripts/setup.sh --test installs it)",
)
def test_an_emulated_zen3_runs_the_avx2_kernels_unasked_and_its_step_gives_the_same_bits(tmp_path):
    """A CPU with no AVX-512 at all: qemu-user's EPYC-Milan (Zen 3: AVX2 and FMA; an AVX-512
    instruction there is SIGILL), while /proc/cpuinfo stays this host's (AVX-512 on some of these
    machines). With no cap the worker asks the CPU, picks avx2, and a whole quantized decode step
    there gives the bits the avx2 variant gives here. Baseline x86-64 (qemu64) gets portable."""
    from tests.worker.test_fused_families import PROMPT, SIZES, fused_logits, tiny
    from worker.models.fused_decode import FusedDecode

    model = tiny("llama")
    ids = torch.randint(1, SIZES["vocab_size"], (PROMPT,), generator=torch.Generator().manual_seed(1))
    torch.save((model.state_dict(), ids), tmp_path / "model.pt")
    zen3 = emulated("EPYC-Milan-v1", str(tmp_path / "model.pt"), str(tmp_path / "logits.pt"))
    assert zen3["chosen"] == zen3["active"] == "avx2", zen3
    assert zen3["line"] == "CPU AMD EPYC-Milan Processor (x86_64: avx2 fma); kernels avx2"
    assert "avx2" in zen3["features"] and not any(f.startswith("avx512") for f in zen3["features"])
    fused = FusedDecode(model, "q4")
    fused.ops = kernels.variant_ops(RUNNABLE["avx2"])
    assert torch.equal(torch.load(tmp_path / "logits.pt"), fused_logits(model, fused, ids, torch.bfloat16))
    baseline = emulated("qemu64")
    assert baseline["chosen"] == "portable" and "avx2" not in baseline["features"], baseline


def test_a_variant_that_does_not_build_falls_to_the_next_one_under_it(monkeypatch):
    """A compiler too old for the chosen variant's flags (gcc 10 has no -mavxvnni) costs that variant
    only: the worker loads the next one the CPU runs, whose ops then serve, not the torch path."""
    first, *rest = cpu.candidates()
    if not rest:
        pytest.skip("one variant only under this cap")
    monkeypatch.setattr(kernels, "_loaded", {k: v for k, v in kernels._loaded.items() if k != first.name})
    monkeypatch.setattr(kernels, "_errors", {})
    monkeypatch.setattr(kernels, "_active", {})
    built = kernels.compile_variant

    def compile_variant(variant):
        if variant == first:
            raise RuntimeError("c++: error: unrecognized command-line option")
        return built(variant)

    monkeypatch.setattr(kernels, "compile_variant", compile_variant)
    assert kernels.load()
    assert kernels.active() == rest[0]
    assert kernels.ops() is getattr(torch.ops, kernels.namespace(rest[0]))
    assert "unrecognized command-line option" in kernels.unavailable_reason()


def test_bf16_is_the_default_only_where_the_cpu_computes_it(monkeypatch):
    """dtype auto: bf16 with AVX512-BF16 or AMX under the avx512 variant; float32 on an AVX2 CPU, or
    under a cap (ours or oneDNN's), where an explicit bf16 is refused in one sentence."""
    from worker.runner.choices import pick_dtype

    monkeypatch.delenv(cpu.CAP_VARIABLE, raising=False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    sapphire = frozenset(RUNNABLE.get("avx512", cpu.VARIANTS[0]).needs | {"avx512_bf16", "amx_bf16"})
    monkeypatch.setattr(cpu, "arch", lambda: "x86_64")
    monkeypatch.setattr(cpu, "features", lambda: sapphire)
    assert pick_dtype("auto") == torch.bfloat16 and pick_dtype("bfloat16") == torch.bfloat16
    monkeypatch.setenv(cpu.CAP_VARIABLE, "avx2")
    assert pick_dtype("auto") == torch.float32
    with pytest.raises(ValueError, match="--dtype bfloat16 needs a CPU that computes it natively"):
        pick_dtype("bfloat16")
    monkeypatch.delenv(cpu.CAP_VARIABLE)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert pick_dtype("auto") == torch.float32
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(cpu, "features", lambda: frozenset({"avx2", "fma", "f16c", "bmi2"}))  # Zen 3
    assert pick_dtype("auto") == torch.float32 and pick_dtype("float32") == torch.float32
    assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16


def test_the_default_engine_answers_alike_on_avx2_and_avx512():
    """The default model with no flags (every batch through the C++ step, float32): the same greedy
    tokens with the avx2 kernels swapped in as with the avx512 ones (the held-out check serves it
    again under LLMPOOL_CPU_ISA=avx2 and expects the same text)."""
    if not {"avx512", "avx2"} <= RUNNABLE.keys():
        pytest.skip("needs a CPU that runs both the avx512 and the avx2 kernels")
    from common.model_source import resolve_model
    from common.protocol import NewRequest, SamplingParams
    from tests.worker.factories import drain, tokens
    from tests.worker.test_engine import PROMPTS
    from worker.build import build_engine
    from worker.config import WorkerConfig

    engine = build_engine(resolve_model("SmolLM2-135M-Instruct"), WorkerConfig(kv_cache_memory="64MiB"))
    assert engine.runner.paths.rows_only
    answers = {}
    for name in ("avx512", "avx2"):
        engine.runner.paths.fused.ops = kernels.variant_ops(RUNNABLE[name])
        news = [NewRequest(f"{name}{i}", ids, 24, SamplingParams(temperature=0)) for i, ids in enumerate(PROMPTS)]
        out = drain(engine, news)
        answers[name] = [tokens(out[f"{name}{i}"]) for i in range(len(PROMPTS))]
    assert answers["avx2"] == answers["avx512"]
