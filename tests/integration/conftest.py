"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import MODEL


@pytest.fixture(scope="session")
def gguf_reference() -> torch.nn.Module:
    """The default model as transformers loads it from its GGUF file (loaded independently of the
    server's conversion), in bf16, once a session: de-quantizing costs seconds. The closeness
    references start from it (test_api's as it is, test_lora's a copy with an adapter); none
    changes it."""
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model

    source = resolve_model(MODEL)
    return AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.bfloat16).eval()
