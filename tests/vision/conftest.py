"""Tiny image-text models for the tests, each built once per session (about 1 s)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vision.models import build_idefics3, build_llava


@pytest.fixture(scope="session")
def llava(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llava")
    build_llava(tokenizer, folder)
    return folder


@pytest.fixture(scope="session")
def idefics3(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("idefics3")
    build_idefics3(tokenizer, folder)
    return folder
