"""An engine for a model: its runner (model, KV cache, kernels) built first, then the engine around it,
linked to a KV store (worker/kv_store) when ``--kv-store`` names one."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from common.config import parse_size
from common.model_source import ModelSource
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.kv_store import Fingerprint, KVStore, open_tier
from worker.pooling_spec import PoolingSpec, pooling_spec
from worker.runner import ModelRunner, pick_device
from worker.runner.kv_blocks import CpuBlockIO, weights_digest

log = logging.getLogger(__name__)


def build_engine(source: ModelSource, config: WorkerConfig) -> Engine:
    """Batch limits left at 0 are filled in for the device first: the runner sizes CUDA graphs by them."""
    config = config.for_device(pick_device(config.device).type)
    if config.max_encoder_images_per_step < 1:
        raise ValueError("--max-encoder-images-per-step must be at least 1 (0: the device's default)")
    spec = pooling_of(source, config)
    if spec is not None and not spec.generates:
        from worker.runner.pooling_runner import PoolingRunner

        if config.kv_store:
            raise ValueError("--kv-store holds KV blocks; a pooling model keeps none (leave it out)")
        return Engine(PoolingRunner(source, config, spec), config)
    runner = ModelRunner(source, config, spec)
    link = kv_store_link(source, config, runner)
    runner.drop_float_weights()
    return Engine(runner, config, link)


def pooling_of(source: ModelSource, config: WorkerConfig) -> PoolingSpec | None:
    """How the model pools (worker/pooling_spec.py), from its config.json; None: it generates."""
    folder = Path(source.path)
    if source.gguf_file is not None:
        return pooling_spec(source.path, [], False, config.pooling, config.pooling_normalize, causal=True)
    if not (folder / "config.json").is_file():
        return pooling_spec(source.path, [], False, config.pooling, config.pooling_normalize)
    from worker.runner.pooling_runner import is_encoder_type

    model_config = json.loads((folder / "config.json").read_text())
    encoder = is_encoder_type(model_config.get("model_type", ""))
    architectures = model_config.get("architectures") or []
    causal = any(a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in architectures)
    return pooling_spec(source.path, architectures, encoder, config.pooling, config.pooling_normalize, causal)


def kv_store_link(source: ModelSource, config: WorkerConfig, runner: ModelRunner) -> functools.partial[KVStore] | None:
    """What links the engine's block manager to the ``--kv-store``, or None without one."""
    if not config.kv_store:
        return None
    if not config.prefix_caching:
        raise ValueError("--kv-store is a tier under the prefix cache: it needs --prefix-caching")
    io = CpuBlockIO(runner.kv_caches)
    dtype = str(runner.dtype).removeprefix("torch.")
    model_config = runner.model.config.to_json_string(use_diff=False)
    fingerprint = Fingerprint(
        model=source.name,
        weights=weights_digest(runner.model, source.cache_dir(config.cache_dir, f"weights-digest-{dtype}")),
        config=hashlib.blake2b(model_config.encode(), digest_size=16).hexdigest(),
        dtype=io.dtype,
        layout=io.layout,
        block_size=config.block_size,
        quantization=runner.quantization
        + ("-only" if runner.paths.rows_only else ""),  # prompts computed from those weights too
    )
    tier = open_tier(config.kv_store, fingerprint, parse_size(config.kv_store_size))
    log.info("KV store: %s, blocks of fingerprint %s (%s, %s)", tier.description, fingerprint.hex, source.name, dtype)
    return functools.partial(KVStore, tier, io, fingerprint.digest())
