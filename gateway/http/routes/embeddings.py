"""POST /v1/embeddings: OpenAI's embeddings dialect over the pooling core (``client.embeddings.create``)."""

from __future__ import annotations

import base64

from litestar import Controller, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from common.pooling import PoolingTask
from gateway.errors import InvalidRequest
from gateway.generate import pooling
from gateway.generate.abilities import require
from gateway.generate.model_registry import ModelRegistry
from gateway.http.routes.common import documented, json_response
from gateway.policy.caller import Caller
from gateway.schemas.pooling import Embedding, EmbeddingList, EmbeddingRequest, EmbeddingUsage


class EmbeddingsController(Controller):
    path = "/v1/embeddings"

    @post("/", status_code=200, responses=documented(EmbeddingList, "one vector per input, in order"))
    async def create(
        self, data: JSONBody[EmbeddingRequest], models: NamedDependency[ModelRegistry], caller: NamedDependency[Caller]
    ) -> Response:
        served = models.get(data.model)
        info = require(served, PoolingTask.EMBED)
        if data.dimensions is not None and info is not None:
            sizes = info.matryoshka_dimensions
            if not info.matryoshka:
                raise InvalidRequest(
                    f"the model `{served.model_name}` does not take `dimensions` (it is not a Matryoshka model)",
                    param="dimensions",
                )
            if not 0 < data.dimensions <= info.dimensions or (sizes and data.dimensions not in sizes):
                allowed = ", ".join(map(str, sizes)) if sizes else f"1 to {info.dimensions}"
                raise InvalidRequest(
                    f"`dimensions` must be one of {allowed}; got {data.dimensions}", param="dimensions"
                )
        inputs = pooling.inputs_of(data.input, "input", served.vocab_size)
        pooled = await pooling.pool(served, inputs, PoolingTask.EMBED, caller, data.dimensions)
        as_base64 = data.encoding_format == "base64"
        data_out = [
            Embedding(
                index=i, embedding=base64.b64encode(p.vector.tobytes()).decode() if as_base64 else p.vector.tolist()
            )
            for i, p in enumerate(pooled)
        ]
        tokens = sum(p.prompt_tokens for p in pooled)
        return json_response(
            EmbeddingList(
                data=data_out,
                model=served.served_name,
                usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
            )
        )
