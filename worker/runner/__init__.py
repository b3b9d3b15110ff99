"""The model runner, split by noun:

model_runner.py  ModelRunner: builds the model, cache, backend and sampler; execute(batch) -> RunOutput
                 (worker/scheduler.py defines the batch and the output records)
choices.py       device, dtype, decode weights, model implementation, CUDA graphs (from the flags)
probe.py         each attention layer's KV shape, mask and features, learned by a 2-token forward
kv_cache.py      how many KV blocks fit the budget, and their tensors (per-layer shapes)
inputs.py        a batch as each path's tensors (flat sequence, C++ rows, verify rows)
paths.py         the execution paths (graph, C++ rows, torch flat, verify), each giving logits
cuda_graphs.py   captured decode steps per batch-size bucket
pooling_runner.py  PoolingRunner: a pooling model (embedder, cross-encoder) with no KV cache; pool(rows) -> vectors
"""

from worker.runner.choices import pick_device, pick_dtype
from worker.runner.model_runner import ModelRunner

__all__ = ["ModelRunner", "pick_device", "pick_dtype"]
