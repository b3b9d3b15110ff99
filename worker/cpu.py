"""What this CPU computes, read once at start, and which kernel variant runs on it.

One build of the C++ kernels serves every CPU of an architecture: each variant (``VARIANTS``) is the
same sources compiled with its own target flags into a library of its own, and the worker loads the
best one whose instructions the CPU has (ggml's ``GGML_CPU_ALL_VARIANTS`` and ATen's
``CPU_CAPABILITY`` do the same). ``LLMPOOL_CPU_ISA`` caps the choice (tests, mixed fleets) and the
worker sets torch's twins of it, ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``, to match
(``cap_torch``, before torch is imported). No torch here: ``worker/__main__.py`` reads it first.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import platform
import struct
import subprocess
from dataclasses import dataclass

CAP_VARIABLE = "LLMPOOL_CPU_ISA"


@dataclass(frozen=True, slots=True)
class Variant:
    """One build of the kernels: what it needs of the CPU (Linux cpuinfo flag names) and how it is compiled."""

    name: str
    arch: str
    needs: frozenset[str]
    cflags: tuple[str, ...]
    aten: str | None  # ATEN_CPU_CAPABILITY under this cap (None: leave torch's own choice)
    onednn: str | None  # ONEDNN_MAX_CPU_ISA under this cap


# Best first, per architecture. avx512 needs VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 and
# later); AVX-512 without it (Skylake-X) runs avx2, and AVX2 with AVX-VNNI (no AVX-512) avxvnni. neon
# needs the dot-product extension (armv8.2: Graviton 2+, Ampere, Apple M1+, Cortex-A76+); neon_i8mm the
# int8 matrix multiply too (smmla: Graviton 3/4, Neoverse V1/V2/N2, Apple M2+; armv8.2-a plus the two
# extensions, not armv8.6-a, whose other features Graviton 3's armv8.4 lacks). No SVE variant: on
# today's 128/256-bit SVE parts it does the int8 work NEON+i8mm does (docs/arm.md).
VARIANTS: tuple[Variant, ...] = (
    Variant(
        "avx512",
        "x86_64",
        frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}),
        ("-march=x86-64-v4", "-mavx512vnni", "-mtune=generic"),
        "avx512",
        None,
    ),
    Variant(  # AVX2 plus 256-bit VNNI: Alder Lake and later client chips, Zen 4/5 client parts, Sierra Forest
        "avxvnni",
        "x86_64",
        frozenset({"avx2", "fma", "f16c", "bmi2", "avx_vnni"}),
        ("-march=x86-64-v3", "-mavxvnni", "-mtune=generic"),
        "avx2",
        "AVX2_VNNI",
    ),
    Variant(
        "avx2",
        "x86_64",
        frozenset({"avx2", "fma", "f16c", "bmi2"}),
        ("-march=x86-64-v3", "-mtune=generic"),
        "avx2",
        "AVX2",
    ),
    Variant("portable", "x86_64", frozenset(), ("-march=x86-64", "-mtune=generic"), "default", "SSE41"),
    Variant(
        "neon_i8mm", "aarch64", frozenset({"asimd", "asimddp", "i8mm"}), ("-march=armv8.2-a+dotprod+i8mm",), None, None
    ),
    Variant("neon", "aarch64", frozenset({"asimd", "asimddp"}), ("-march=armv8.2-a+dotprod",), None, None),
    Variant("portable", "aarch64", frozenset(), ("-march=armv8-a",), None, None),
)


def arch(machine: str | None = None) -> str:
    """x86_64 or aarch64: this machine's, or ``machine`` named as macOS or Docker's platforms name it
    (arm64, amd64)."""
    machine = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


# Linux's aarch64 hardware capabilities (uapi asm/hwcap.h: (auxiliary-vector key, bit)) under the names
# /proc/cpuinfo's Features line gives them.
_AT_HWCAP, _AT_HWCAP2 = 16, 26
_ARM_HWCAPS = {
    (_AT_HWCAP, 0): "fp", (_AT_HWCAP, 1): "asimd", (_AT_HWCAP, 20): "asimddp", (_AT_HWCAP, 22): "sve",
    (_AT_HWCAP2, 1): "sve2", (_AT_HWCAP2, 13): "i8mm", (_AT_HWCAP2, 14): "bf16",
}  # fmt: skip


def arm_hwcaps(path: str = "/proc/self/auxv") -> frozenset[str] | None:
    """What Linux grants this aarch64 process, from its auxiliary vector (ggml reads it with getauxval).
    /proc/cpuinfo says the same on a real ARM machine, but under qemu-user (an arm64 container on an x86
    host, binfmt_misc) it is the host's x86 file, while qemu writes the emulated CPU's capabilities here."""
    try:
        with open(path, "rb") as auxv:
            data = auxv.read()
    except OSError:
        return None
    vector = dict(struct.iter_unpack("=QQ", data[: len(data) // 16 * 16]))
    if _AT_HWCAP not in vector:
        return None
    return frozenset(name for (key, bit), name in _ARM_HWCAPS.items() if vector.get(key, 0) >> bit & 1)


# x86-64 machine code (System V ABI), called through ctypes. cpuid(leaf, subleaf, out): eax, ebx, ecx
# and edx into out[0..3] (push rbx; mov eax, edi; mov ecx, esi; mov r8, rdx; cpuid; mov [r8], eax;
# mov [r8+4], ebx; mov [r8+8], ecx; mov [r8+12], edx; pop rbx; ret). xgetbv(): XCR0, the register
# states the OS saves (xor ecx, ecx; xgetbv; shl rdx, 32; or rax, rdx; ret).
_CPUID = bytes.fromhex("53 89f8 89f1 4989d0 0fa2 418900 41895804 41894808 4189500c 5b c3")
_XGETBV = bytes.fromhex("31c9 0f01d0 48c1e220 4809d0 c3")
_EAX, _EBX, _ECX, _EDX = range(4)
_YMM, _ZMM, _TILE = 0x6, 0xE6, 0x60000  # XCR0 bits: SSE+AVX; +opmask, ZMM_Hi256, Hi16_ZMM; XTILECFG+XTILEDATA
# Linux's names for the flags the variants and the start-up line use: (leaf, subleaf, register, bit, XCR0 states).
_X86_FLAGS = {
    "fma": (1, 0, _ECX, 12, _YMM), "avx": (1, 0, _ECX, 28, _YMM), "f16c": (1, 0, _ECX, 29, _YMM),
    "avx2": (7, 0, _EBX, 5, _YMM), "bmi2": (7, 0, _EBX, 8, 0), "avx512f": (7, 0, _EBX, 16, _ZMM),
    "avx512dq": (7, 0, _EBX, 17, _ZMM), "avx512bw": (7, 0, _EBX, 30, _ZMM), "avx512vl": (7, 0, _EBX, 31, _ZMM),
    "avx512_vnni": (7, 0, _ECX, 11, _ZMM), "amx_bf16": (7, 0, _EDX, 22, _TILE), "avx512_fp16": (7, 0, _EDX, 23, _ZMM),
    "amx_tile": (7, 0, _EDX, 24, _TILE), "amx_int8": (7, 0, _EDX, 25, _TILE), "avx_vnni": (7, 1, _EAX, 4, _YMM),
    "avx512_bf16": (7, 1, _EAX, 5, _ZMM),
}  # fmt: skip


@functools.cache
def x86_cpuid() -> tuple[dict[tuple[int, int], tuple[int, ...]], int] | None:
    """The cpuid leaves this module reads (leaf, subleaf -> eax, ebx, ecx, edx) and XCR0, asked of the
    CPU as ggml, ATen and numpy ask them; None where machine code cannot be mapped executable (a W^X
    policy: /proc/cpuinfo decides then)."""
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, AttributeError):
        return None
    page.write(_CPUID + _XGETBV)
    code = ctypes.c_char.from_buffer(page)
    base = ctypes.addressof(code)
    call = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32))(base)
    out = (ctypes.c_uint32 * 4)()

    def cpuid(leaf: int, subleaf: int = 0) -> tuple[int, ...]:
        call(leaf, subleaf, out)
        return tuple(out)

    top, extended = cpuid(0)[_EAX], cpuid(0x80000000)[_EAX]
    leaves = {(1, 0): cpuid(1)}
    if top >= 7:
        leaves[(7, 0)] = cpuid(7, 0)
        if leaves[(7, 0)][_EAX] >= 1:  # subleaf 1 exists
            leaves[(7, 1)] = cpuid(7, 1)
    if extended >= 0x80000004:  # the brand string
        leaves |= {(leaf, 0): cpuid(leaf) for leaf in (0x80000002, 0x80000003, 0x80000004)}
    xcr0 = 0
    if leaves[(1, 0)][_ECX] >> 27 & 1:  # OSXSAVE: xgetbv exists and the OS uses it
        xcr0 = ctypes.CFUNCTYPE(ctypes.c_uint64)(base + len(_CPUID))()
    del code  # the page's last export: it can close now
    page.close()
    return leaves, xcr0


def x86_flags() -> frozenset[str] | None:
    """What this x86-64 process can execute: the CPU's cpuid bits whose register states the OS saves.
    /proc/cpuinfo says the same on a real machine, but under an x86 emulator (qemu-user, an amd64
    container on an ARM Mac) it is the host's file, and an AVX-512 flag there was a SIGILL on an
    emulated Zen 3 that has none."""
    if (asked := x86_cpuid()) is None:
        return None
    leaves, xcr0 = asked
    return frozenset(
        name
        for name, (leaf, subleaf, register, bit, states) in _X86_FLAGS.items()
        if (leaf, subleaf) in leaves and leaves[(leaf, subleaf)][register] >> bit & 1 and xcr0 & states == states
    )


def cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first core's flags (x86) or Features (aarch64) line of Linux's /proc/cpuinfo; None without one."""
    try:
        with open(path) as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


@functools.cache
def features() -> frozenset[str]:
    """The CPU's instruction-set flags as Linux's /proc/cpuinfo names them (x86-64: from cpuid and XCR0;
    aarch64 Linux: from the auxiliary vector; macOS on Apple silicon: from sysctl)."""
    if arch() == "x86_64" and (flags := x86_flags()) is not None:
        return flags
    if platform.system() == "Linux" and arch() == "aarch64" and (hwcaps := arm_hwcaps()) is not None:
        return hwcaps
    if (listed := cpuinfo_flags()) is not None:
        return listed
    if platform.system() == "Darwin" and arch() == "aarch64":  # every Apple-silicon core has these
        found = {"asimd"}
        if _sysctl("hw.optional.arm.FEAT_DotProd") == "1":
            found.add("asimddp")
        if _sysctl("hw.optional.arm.FEAT_I8MM") == "1":  # M2 and later
            found.add("i8mm")
        if _sysctl("hw.optional.arm.FEAT_BF16") == "1":
            found.add("bf16")
        return frozenset(found)
    return frozenset()


def _sysctl(name: str) -> str:
    try:
        return subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def model_name() -> str:
    """The CPU's name, for the start-up line: on x86-64 its cpuid brand string (an emulated CPU's own)."""
    if arch() == "x86_64" and (asked := x86_cpuid()) and (0x80000002, 0) in asked[0]:
        brand = b"".join(struct.pack("<4I", *asked[0][(leaf, 0)]) for leaf in (0x80000002, 0x80000003, 0x80000004))
        if name := brand.split(b"\0")[0].decode("ascii", "replace").strip():
            return name
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cap() -> str | None:
    """``LLMPOOL_CPU_ISA``, checked: the name of one of this architecture's ``VARIANTS``, or None."""
    value = os.environ.get(CAP_VARIABLE, "").strip().lower()
    if not value:
        return None
    names = [v.name for v in VARIANTS if v.arch == arch()]
    if value not in names:
        raise ValueError(
            f"{CAP_VARIABLE}={value!r} is not an instruction set of this {arch()} CPU's builds: use one of {', '.join(names)}"
        )
    return value


def runnable(flags: frozenset[str] | None = None) -> list[Variant]:
    """The variants this CPU executes, best first (whatever the cap)."""
    flags = features() if flags is None else flags
    return [v for v in VARIANTS if v.arch == arch() and v.needs <= flags]


def candidates() -> list[Variant]:
    """The variants the CPU runs at or under the cap, best first, portable last: the worker loads the
    first that builds (a compiler too old for a variant's flags, gcc 10 and ``-mavxvnni``, falls to the
    next one rather than to the torch path)."""
    ours = [v for v in VARIANTS if v.arch == arch()]
    if not ours:
        raise RuntimeError(f"no C++ kernel variant for the {arch()} architecture")
    limit = cap()
    allowed = ours[[v.name for v in ours].index(limit) :] if limit else ours
    return [v for v in allowed if v.needs <= features() or v.name == "portable"]


def chosen() -> Variant:
    """The best variant the CPU runs at or under the cap (portable at worst)."""
    return candidates()[0]


def native_bf16() -> bool:
    """Whether bf16 is computed natively under the chosen variant: AVX512-BF16 or AMX on x86. Elsewhere
    torch emulates it (several times float32's cost, and oneDNN refuses to pack its weights)."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()  # capped below bf16: torch's bf16 is emulated
    uncapped = onednn == "ALL" or any(part in onednn for part in ("BF16", "AMX", "FP16", "AVX10"))
    return chosen().name == "avx512" and uncapped and bool({"avx512_bf16", "amx_bf16"} & features())


def cap_torch() -> None:
    """Under ``LLMPOOL_CPU_ISA``, cap torch's own kernels to match (unless set already); call before
    torch is imported: ATen and oneDNN read them once. A cap that names no variant is left to the
    engine's start, which refuses it in the worker's start-up report."""
    try:
        if cap() is None:
            return
    except ValueError:
        return
    variant = chosen()
    if variant.aten:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", variant.aten)
    if variant.onednn:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", variant.onednn)


def describe() -> str:
    """One line for the start-up log: the CPU, the instruction sets that matter here, and the variant."""
    interesting = (
        "avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "asimddp", "i8mm", "bf16", "sve",
    )  # fmt: skip
    present = [flag for flag in interesting if flag in features()]
    limit = cap()
    return f"CPU {model_name()} ({arch()}: {' '.join(present) or 'baseline only'}); kernels {chosen().name}" + (
        f" ({CAP_VARIABLE}={limit})" if limit else ""
    )
