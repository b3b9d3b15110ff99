"""GET /v1/models and /v1/models/{model_id}: every model some worker has brought, with its context
length and how many workers serve it now."""

from __future__ import annotations

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath

from gateway.model_registry import ModelRegistry
from gateway.routes.common import documented, json_response


class ModelsController(Controller):
    path = "/v1/models"

    @get("/")
    async def list_models(self, models: NamedDependency[ModelRegistry]) -> Response:
        return json_response({"object": "list", "data": models.cards()})

    @get("/{model_id:path}", responses=documented(None))
    async def get_model(self, model_id: FromPath[str], models: NamedDependency[ModelRegistry]) -> Response:
        return json_response(models.card(model_id.lstrip("/")))
