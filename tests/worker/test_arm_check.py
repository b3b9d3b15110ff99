"""The aarch64 NEON primitives (worker/kernels/isa_neon.h) against the portable ones, on an x86 machine:
tests/arm/neon_vs_portable.cpp cross-compiled with the neon and the neon_i8mm variant's flags (the
latter checks the smmla row pairs too) and run under qemu-user (scripts/arm_check.sh's standalone
step; docs/arm.md). Skipped where the cross compiler or qemu is not installed (the script installs
them: apt-get install g++-aarch64-linux-gnu qemu-user-static)."""

import shutil
import subprocess
from pathlib import Path

import pytest

from worker.cpu import VARIANTS

REPO = Path(__file__).resolve().parents[2]
CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64-static") or shutil.which("qemu-aarch64")
CHECKS = {"neon": 20, "neon_i8mm": 22}  # at least these checks per build (i8mm: dot_pair on int8 and q4 rows too)


@pytest.mark.skipif(
    CXX is None or QEMU is None,
    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu qemu-user-static)",
)
@pytest.mark.parametrize("variant", sorted(CHECKS))
def test_neon_primitives_match_portable_under_qemu(tmp_path, variant):
    binary = tmp_path / "neon_vs_portable"
    (march,) = next(v.cflags for v in VARIANTS if v.name == variant)
    # The variant's flags (worker/cpu.py, worker/kernels/compile.py), static: no aarch64 libc needed to run.
    build = subprocess.run(
        [
            CXX,
            "-std=c++20",
            "-static",
            "-O3",
            "-ffp-contract=fast",
            march,
            "-I",
            str(REPO / "tests/arm/stub"),
            "-I",
            str(REPO / "worker/kernels"),
            str(REPO / "tests/arm/neon_vs_portable.cpp"),
            "-o",
            str(binary),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    # -cpu max: the emulated CPU has the dot-product (sdot) and int8 matrix-multiply (smmla) extensions.
    run = subprocess.run([QEMU, "-cpu", "max", str(binary), "2000"], capture_output=True, text=True, timeout=120)
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1].endswith(" 0 failed"), run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = int(lines[-1].split()[0])
    assert passed >= CHECKS[variant], lines[-1]
