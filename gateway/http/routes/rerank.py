"""POST /v1/rerank (the Cohere/Jina shape, as vLLM serves it; also /rerank and /v2/rerank) and
/v1/score (vLLM's; also /score) over the pooling core. A cross-encoder scores each (query,
document) pair in one pass; an embedding model scores them by the cosine of their vectors."""

from __future__ import annotations

import math
import time
import uuid
from array import array

from litestar import Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from common.pooling import PoolingTask
from gateway.errors import InvalidRequest
from gateway.generate import pooling
from gateway.generate.abilities import require
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.served_model import ServedModel
from gateway.http.routes.common import documented, json_response
from gateway.policy.caller import Caller
from gateway.schemas.pooling import (
    RerankDocumentObject,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoreUsage,
)


async def scores(served: ServedModel, caller: Caller, pairs: list[tuple[str, str]]) -> tuple[list[float], int]:
    """Each pair's score and the prompt tokens read; 400 for a generation model."""
    info = require(served, PoolingTask.SCORE)
    if info is not None and PoolingTask.EMBED not in info.tasks:  # a cross-encoder: both texts in one sequence
        pooled = await pooling.pool(served, [pooling.Input(q, d) for q, d in pairs], PoolingTask.SCORE, caller)
        return [p.vector[0] for p in pooled], sum(p.prompt_tokens for p in pooled)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
    pooled = await pooling.pool(served, [pooling.Input(t) for t in texts], PoolingTask.EMBED, caller)
    vectors = dict(zip(texts, (p.vector for p in pooled)))
    return [cosine(vectors[q], vectors[d]) for q, d in pairs], sum(p.prompt_tokens for p in pooled)


def cosine(a: array, b: array) -> float:
    norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b)) / norms if norms else 0.0


def _texts(value: str | list[str] | None, param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value or []
    if not texts or any(not isinstance(t, str) or not t for t in texts):
        raise InvalidRequest(f"`{param}` must be a non-empty string or list of non-empty strings", param=param)
    if len(texts) > pooling.MAX_INPUTS:
        raise InvalidRequest(f"`{param}` may hold at most {pooling.MAX_INPUTS} texts; got {len(texts)}", param=param)
    return texts


@post(
    ["/v1/rerank", "/rerank", "/v2/rerank"],
    status_code=200,
    responses=documented(RerankResponse, "the documents by relevance, best first"),
)
async def rerank(
    data: JSONBody[RerankRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
) -> Response:
    served = models.get(data.model)
    documents = [d.text if isinstance(d, RerankDocumentObject) else d for d in data.documents]
    _texts(data.query, "query")
    _texts(documents, "documents")
    if data.top_n is not None and data.top_n < 0:
        raise InvalidRequest(f"`top_n` must be 0 (all) or more; got {data.top_n}", param="top_n")
    found, tokens = await scores(served, caller, [(data.query, d) for d in documents])
    order = sorted(range(len(documents)), key=lambda i: -found[i])[: data.top_n or None]
    results = [
        RerankResult(
            index=i,
            relevance_score=found[i],
            document=RerankDocumentObject(text=documents[i]) if data.return_documents else None,
        )
        for i in order
    ]
    body = RerankResponse(
        id=f"rerank-{uuid.uuid4().hex}",
        model=served.served_name,
        results=results,
        usage=RerankUsage(total_tokens=tokens),
    )
    return json_response(body)


@post(["/v1/score", "/score"], status_code=200, responses=documented(ScoreResponse, "one score per pair"))
async def score(
    data: JSONBody[ScoreRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
) -> Response:
    served = models.get(data.model)
    first_param, second_param = ("queries", "documents") if data.queries is not None else ("text_1", "text_2")
    first = _texts(data.queries if data.queries is not None else data.text_1, first_param)
    second = _texts(data.documents if data.documents is not None else data.text_2, second_param)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise InvalidRequest(
            f"`{first_param}` must hold one text or as many as `{second_param}` ({len(second)}); got {len(first)}",
            param=first_param,
        )
    found, tokens = await scores(served, caller, list(zip(first, second)))
    data_out = [ScoreData(index=i, score=s) for i, s in enumerate(found)]
    usage = ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)
    return json_response(
        ScoreResponse(
            id=f"score-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=served.served_name,
            data=data_out,
            usage=usage,
        )
    )
