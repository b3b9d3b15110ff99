"""Tiny image-text models for the tests, each built once per session (about 1 s)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.vision.models import build_idefics3, build_llava, build_qwen_vl, image_bytes
from tests.vision.more_models import build_gemma3, build_llava_onevision, build_mistral3


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


LATER = {  # built on first use, by family
    "smolvlm": partial(build_idefics3, kind="SmolVLM"),
    "qwen2_vl": partial(build_qwen_vl, kind="qwen2_vl"),
    "qwen2_5_vl": partial(build_qwen_vl, kind="qwen2_5_vl"),
    "qwen3_vl": partial(build_qwen_vl, kind="qwen3_vl"),
    "qwen3_vl_moe": partial(build_qwen_vl, kind="qwen3_vl_moe"),
    "gemma3": build_gemma3,
    "llava_onevision": build_llava_onevision,
    "mistral3": build_mistral3,
    "pixtral": partial(build_mistral3, kind="pixtral"),
}


@pytest.fixture(scope="session")
def vlm(tokenizer, tmp_path_factory: pytest.TempPathFactory, llava: Path, idefics3: Path) -> Callable[[str], Path]:
    """The folder of a family's tiny model, by the family's name."""
    folders = {"llava": llava, "idefics3": idefics3}

    def folder(family: str) -> Path:
        if family not in folders:
            folders[family] = tmp_path_factory.mktemp(family)
            LATER[family](tokenizer, folders[family])
        return folders[family]

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
