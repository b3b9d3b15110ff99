"""``python -m worker.kernels``: build the C++ kernels now (scripts/setup.sh), so no worker start pays for it."""

import time

from worker import kernels

started = time.perf_counter()
ok = kernels.load()
print(
    f"llmpool C++ kernels: {'ready' if ok else 'FAILED: ' + str(kernels.unavailable_reason())} ({time.perf_counter() - started:.1f} s)"
)
raise SystemExit(0 if ok else 1)
