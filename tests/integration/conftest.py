"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.conftest import MODEL

if TYPE_CHECKING:  # torch only once a test asks for the model: other modules' collection stays light
    import torch


@pytest.fixture(scope="session")
def gguf_reference() -> torch.nn.Module:
    """The default model as transformers loads it from its GGUF file (loaded independently of the
    server's conversion), in bf16, once a session: de-quantizing costs seconds. The closeness
    references start from it (test_api's as it is, test_lora's a copy with an adapter); none
    changes it."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.model_source import resolve_model

    source = resolve_model(MODEL)
    return AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.bfloat16).eval()
