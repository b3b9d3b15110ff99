"""GET /v1/models and /v1/models/{model_id}."""

from __future__ import annotations

import time

from litestar import Controller, Response, get

from gateway.generation import Generator
from gateway.routes.common import check_model, documented, json_response

STARTED = time.time()


def model_card(generator: Generator) -> dict:
    card = {"id": generator.model_name, "object": "model", "created": int(STARTED), "owned_by": "llmpool"}
    if (max_model_len := generator.max_model_len()) is not None:
        card["max_model_len"] = max_model_len
    return card


class ModelsController(Controller):
    path = "/v1/models"

    @get("/")
    async def list_models(self, generator: Generator) -> Response:
        return json_response({"object": "list", "data": [model_card(generator)]})

    @get("/{model_id:str}", responses=documented(None))
    async def get_model(self, model_id: str, generator: Generator) -> Response:
        check_model(model_id, generator.model_name)
        return json_response(model_card(generator))
