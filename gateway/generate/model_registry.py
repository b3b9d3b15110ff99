"""The models this gateway serves, each learned from the first of its workers to register.

The gateway holds no model files. A worker's ``ModelInfo`` brings its model's tokenizer and chat
template; ``learn`` turns it into that model's ``ServedModel``. Routes ask ``get(name)`` for the
model a request names: a name never seen is a 404, a model whose workers are all gone (or whose
tokenizer is still loading) a 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time

from common.model_source import read_chat_template, unpack_bundle
from common.protocol import ModelInfo, NewRequest
from gateway.errors import NotFound, NoWorkerAvailable
from gateway.fleet.lora import adapters_of, find
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.workers import RequestStream
from gateway.generate.abilities import tasks
from gateway.generate.lanes import Lanes
from gateway.generate.media import MediaRules
from gateway.generate.reasoning import model_markers
from gateway.generate.served_model import ServedModel
from gateway.generate.templates import ChatTemplate
from gateway.generate.vision import Vision
from gateway.ops.metrics import Metrics
from gateway.policy.admission import Admission
from gateway.policy.rules import Rules

log = logging.getLogger(__name__)


class ModelRegistry:
    """Served model name -> its ServedModel, plus the pool every model shares."""

    def __init__(
        self,
        client: WorkerClient,
        metrics: Metrics,
        admission: Admission,
        lanes: Lanes,
        timeout_s: float,
        reasoning_parser: str = "auto",
        rules: Rules | None = None,
    ) -> None:
        self.client = client
        self.metrics = metrics
        self.admission = admission
        self.lanes = lanes
        self.timeout_s = timeout_s
        self.reasoning_parser = reasoning_parser
        self.rules = rules if rules is not None else Rules()  # every served model's (gateway/policy/rules.py)
        self.served_models: dict[str, ServedModel] = {}
        self.media = MediaRules()  # how images are fetched (gateway/generate/media.py): set from the flags
        self.first_seen: dict[str, int] = {}  # model -> unix time it was learned (``created`` in /v1/models)

    async def learn(self, info: ModelInfo) -> None:
        """Load the tokenizer a worker sent (in a thread: about 0.3 s) and serve its model."""
        tokenizer, processor = await asyncio.to_thread(unpack_bundle, info.files)
        source = read_chat_template(None, info.chat_template or getattr(tokenizer, "chat_template", None))
        template = ChatTemplate(source, {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token})
        markers = await asyncio.to_thread(model_markers, self.reasoning_parser, tokenizer, source)
        self.served_models[info.model] = ServedModel(
            self.client,
            tokenizer,
            template,
            info.model,
            self.lanes,
            self.metrics,
            self.admission,
            self.timeout_s,
            markers,
            self.rules,
        )
        served = self.served_models[info.model]
        served.vision = Vision(processor) if getattr(processor, "image_token", None) else None  # images, or none
        served.media = self.media
        self.first_seen.setdefault(info.model, int(time.time()))

    def get(self, name: str | None) -> ServedModel:
        """The served model a request names (None, where the field is optional: the only
        model, if there is one); 404 if never seen, 503 if it has no live worker."""
        if name is None and len(self.served_models) == 1:
            name = next(iter(self.served_models))
        served = self.served_models.get(name or "")
        base = find(self.client.models, name) if served is None and name else None
        if base in self.served_models:  # a LoRA adapter: its base model's, each request with the adapter
            served = copy.copy(self.served_models[base])
            served.client = AdapterClient(self.client, name)
            served.served_name = name
        if served is None:
            if name in self.client.models:
                raise NoWorkerAvailable(f"the model `{name}` is starting (its tokenizer is loading); retry shortly")
            served = ", ".join(f"`{m}`" for m in sorted(self.served_models)) or "none yet (no worker has registered)"
            raise NotFound(
                f"the model `{name}` does not exist; this server serves {served}", param="model", code="model_not_found"
            )
        if not self.client.available(served.model_name):
            raise NoWorkerAvailable(f"no worker of `{served.model_name}` is taking requests right now; retry shortly")
        return served

    def cards(self) -> list[dict]:
        """One OpenAI model object per served model, with its context length and live workers;
        then its LoRA adapters, with ``parent`` (the base model) and ``root`` (their folder), as vLLM lists them."""
        cards = [self.card(name) for name in sorted(self.served_models)]
        return cards + [self.adapter_card(name) for card in cards for name in sorted(self.adapters(card["id"]))]

    def adapters(self, model: str) -> dict[str, str]:
        pool = self.client.models.get(model)
        return adapters_of(pool) if pool is not None else {}

    def adapter_card(self, name: str) -> dict:
        base = find(self.client.models, name) or ""
        created = self.first_seen.get(base, 0)
        root = self.adapters(base).get(name, "")
        return {"id": name, "object": "model", "created": created, "owned_by": "llmpool", "root": root, "parent": base}

    def card(self, name: str) -> dict:
        if name not in self.served_models:
            if find(self.client.models, name) in self.served_models:
                return self.adapter_card(name)
            self.get(name)  # the 404
        pool = self.client.models.get(name)
        workers = list(pool.workers.values()) if pool is not None else []
        card: dict = {
            "id": name,
            "object": "model",
            "created": self.first_seen.get(name, 0),
            "owned_by": "llmpool",
            "workers": len(workers),
        }
        info = workers[0].ready.pooling if workers else None
        card["capabilities"] = tasks(info)  # generate, or embed and score (gateway/generate/abilities.py)
        if workers:
            card["max_model_len"] = min(w.ready.max_model_len for w in workers)
        if info is not None:
            card["pooling"] = {"method": info.method, "normalize": info.normalize, "dimensions": info.dimensions}
            if info.matryoshka:
                card["pooling"]["matryoshka_dimensions"] = info.matryoshka_dimensions or None
        return card

    def close(self) -> None:
        self.lanes.close()


class AdapterClient:
    """The worker client as the served model of the adapter ``name`` sees it: every request it submits
    runs with the adapter (``NewRequest.lora``); everything else is the base model's client."""

    def __init__(self, client: WorkerClient, name: str) -> None:
        self._client = client
        self.lora = name

    def submit(self, request: NewRequest, *args: object, **kwargs: object) -> RequestStream:
        """``WorkerClient.submit``, the request carrying the adapter."""
        request.lora = self.lora
        return self._client.submit(request, *args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)
