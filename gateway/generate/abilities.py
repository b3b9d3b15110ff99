"""What each model can do, as its workers said in their ``Ready`` (``pooling``: common/pooling.py):
generate, embed, score. A request for something its model does not do is a 400 that says what it does."""

from __future__ import annotations

from common.pooling import PoolingInfo, PoolingTask
from gateway.errors import InvalidRequest
from gateway.generate.served_model import ServedModel

ENDPOINTS = {
    PoolingTask.GENERATE: "text generation",
    PoolingTask.EMBED: "/v1/embeddings",
    PoolingTask.SCORE: "/v1/score and /v1/rerank",
}


def abilities(served: ServedModel) -> PoolingInfo | None:
    """What the model's workers said they can pool (None: a generation model)."""
    pool = served.client.models.get(served.model_name)
    return next((w.ready.pooling for w in pool.workers.values()), None) if pool is not None else None


def tasks(info: PoolingInfo | None) -> list[str]:
    return list(info.tasks) if info is not None else [PoolingTask.GENERATE]


def require(served: ServedModel, task: str) -> PoolingInfo | None:
    """A 400 that says what the model does when it does not do ``task``."""
    info = abilities(served)
    if task not in tasks(info):
        what = (
            "a generation model"
            if info is None
            else "an embedding model"
            if PoolingTask.EMBED in info.tasks
            else "a reranker"
        )
        serves = " and ".join(ENDPOINTS[t] for t in tasks(info))
        hint = (
            "; to embed with it too, start its workers with `--pooling last` (or mean, cls: "
            "`llmpool worker --pooling last ...`, LLMPOOL_POOLING=last)"
            if info is None and task == PoolingTask.EMBED
            else ""
        )
        raise InvalidRequest(
            f"the model `{served.model_name}` is {what}: it serves {serves}, not {ENDPOINTS[task]}{hint}",
            param="model",
            code="model_not_supported",
        )
    return info
