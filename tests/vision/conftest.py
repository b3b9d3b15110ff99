"""One tiny LLaVA for the module's tests, built once per session (about 1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vision.models import build_llava


@pytest.fixture(scope="session")
def llava(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llava")
    build_llava(tokenizer, folder)
    return folder
