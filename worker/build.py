"""An engine for a model: its runner (model, KV cache, kernels) built first, then the engine around it."""

from __future__ import annotations

from common.model_source import ModelSource
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.runner import ModelRunner, pick_device


def build_engine(source: ModelSource, config: WorkerConfig) -> Engine:
    """Batch limits left at 0 are filled in for the device first: the runner sizes CUDA graphs by them."""
    config = config.for_device(pick_device(config.device).type)
    return Engine(ModelRunner(source, config), config)
