"""Fixtures of the worker's tests: ``ops``, each C++ kernel variant this CPU executes."""

import pytest

from worker import cpu, kernels


@pytest.fixture(params=[v.name for v in cpu.runnable()], scope="session")
def ops(request):
    """One kernel variant's ops (on an AVX-512 machine: avx512, avx2 and portable; on an AVX2 one:
    avx2 and portable), so every test that takes it runs once per variant."""
    return kernels.variant_ops(next(v for v in cpu.runnable() if v.name == request.param))
