"""Tiny image-text models for the tests, each built once per session (about 1 s)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vision.models import build_idefics3, build_llava, build_qwen_vl, image_bytes


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


@pytest.fixture(scope="session")
def smolvlm(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("smolvlm")
    build_idefics3(tokenizer, folder, kind="SmolVLM")
    return folder


@pytest.fixture(scope="session")
def qwen2_vl(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_vl")
    build_qwen_vl(tokenizer, folder, kind="qwen2_vl")
    return folder


@pytest.fixture(scope="session")
def qwen3_vl(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3_vl")
    build_qwen_vl(tokenizer, folder, kind="qwen3_vl")
    return folder


@pytest.fixture(scope="session")
def qwen2_5_vl(tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    build_qwen_vl(tokenizer, folder, kind="qwen2_5_vl")
    return folder


class _Images(http.server.BaseHTTPRequestHandler):
    """/ok.png: a small image; /loop: a redirect to itself; anything else 5,000 bytes of not an
    image (/nolength without its Content-Length)."""

    def do_GET(self) -> None:
        if self.path.startswith("/loop"):
            self.send_response(302)
            self.send_header("Location", "/loop")
            self.end_headers()
            return
        body = image_bytes(1) if self.path == "/ok.png" else b"x" * 5000
        self.send_response(200)
        if self.path != "/nolength":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def image_host() -> Iterator[str]:
    """An HTTP server on loopback, for the fetch rules."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
