"""``python -m worker.kernels [--all]``: build the C++ kernels now (scripts/setup.sh), so no worker
start pays for it: the variant this CPU runs, or with ``--all`` every variant of the architecture (an
image built here then runs on any CPU of it)."""

import sys
import time

from worker import cpu
from worker.kernels.compile import compile_variant

started = time.perf_counter()
wanted = [v for v in cpu.VARIANTS if v.arch == cpu.arch()] if "--all" in sys.argv[1:] else [cpu.chosen()]
failed = []
for variant in wanted:
    try:
        compile_variant(variant)
    except Exception as exc:
        failed.append(f"{variant.name}: {exc}")
print(cpu.describe())
print(
    f"llmpool C++ kernels {', '.join(v.name for v in wanted)}: "
    f"{'ready' if not failed else 'FAILED: ' + '; '.join(failed)} ({time.perf_counter() - started:.1f} s)"
)
raise SystemExit(1 if failed else 0)
