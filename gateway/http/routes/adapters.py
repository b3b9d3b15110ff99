"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's runtime LoRA API (its bodies and
its plain-text answers), behind the API key like every other route. A load goes to every worker of
the base model, which reads and checks the adapter before answering; once all have it, requests
naming ``lora_name`` as their model run with it, and /v1/models lists it with its ``parent``.
Both are recorded for the whole fleet (gateway/fleet/lora.py): other gateways and workers that join
later follow within a heartbeat."""

from __future__ import annotations

import msgspec
from litestar import Controller, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from gateway.errors import InvalidRequest, NotFound
from gateway.fleet.lora import find, serves
from gateway.generate.model_registry import ModelRegistry
from gateway.http.routes.common import documented


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    base_model_name: str | None = None  # which served model it adapts; may be left out while one model is served


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; ignored


def _text(message: str) -> Response:
    return Response(content=message, media_type="text/plain")


class LoraController(Controller):
    path = "/v1"

    @post("/load_lora_adapter", status_code=200, responses=documented(None))
    async def load(self, data: JSONBody[LoadLoraAdapterRequest], models: NamedDependency[ModelRegistry]) -> Response:
        name, path = data.lora_name.strip(), data.lora_path.strip()
        if not name or not path:
            raise InvalidRequest("`lora_name` and `lora_path` must both be given", param="lora_name")
        if name in models.served_models or find(models.client.models, name) is not None:
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if data.base_model_name is None and len(models.served_models) > 1:
            served = ", ".join(f"`{m}`" for m in sorted(models.served_models))
            raise InvalidRequest(f"`base_model_name` must say which model it adapts: {served}", param="base_model_name")
        base = models.get(data.base_model_name)  # the only model when none is named; 404 for an unknown one
        await models.client.loras.load(base.model_name, models.client.available(base.model_name), name, path)
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    @post("/unload_lora_adapter", status_code=200, responses=documented(None))
    async def unload(
        self, data: JSONBody[UnloadLoraAdapterRequest], models: NamedDependency[ModelRegistry]
    ) -> Response:
        name, loras = data.lora_name, models.client.loras
        # Served now, or loaded at runtime though no worker could read it (still the fleet's to unload)
        base = find(models.client.models, name) or next((m for m, a in loras.wanted.items() if a.get(name)), None)
        if base is None:
            raise NotFound(f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found")
        pool = models.client.models.get(base)
        await loras.unload(base, [w for w in pool.workers.values() if serves(w, name)] if pool else [], name)
        return _text(f"Success: LoRA adapter '{name}' removed successfully.")
