"""GET /v1/models and /v1/models/{model_id}: every model some worker has brought, with its context
length, what it can do (``capabilities``: generate, or embed and score) and how many workers serve
it now. The anthropic SDK's ``models.list()`` / ``models.retrieve()`` (requests that carry
``anthropic-version``) get Anthropic's shape: ``type``, ``display_name``, ``created_at``, pages.
A managed key limited to some models sees only those (adapters too, by the name listed): the others
are a 404, as OpenAI answers a model the key has no access to."""

from __future__ import annotations

from datetime import datetime, timezone

from litestar import Controller, Request, Response, get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from gateway.errors import InvalidRequest, NotFound
from gateway.generate.model_registry import ModelRegistry
from gateway.http.auth import caller_key
from gateway.http.routes.common import documented, json_response


def anthropic_model(card: dict) -> dict:
    created = datetime.fromtimestamp(card["created"], timezone.utc).isoformat().replace("+00:00", "Z")
    return {"type": "model", "id": card["id"], "display_name": card["id"], "created_at": created}


def anthropic_page(cards: list[dict], limit: int, after_id: str | None, before_id: str | None) -> dict:
    """One page as Anthropic pages its model list: ``after_id``/``before_id`` cursors, ``has_more``."""
    if not 1 <= limit <= 1000:
        raise InvalidRequest(f"`limit` must be between 1 and 1000; got {limit}", param="limit")
    ids = [c["id"] for c in cards]
    if after_id is not None:
        cards = cards[ids.index(after_id) + 1 :] if after_id in ids else []
    if before_id is not None:
        cards = cards[: ids.index(before_id)] if before_id in ids else []
        page = cards[-limit:]
        more = len(cards) > limit
    else:
        page, more = cards[:limit], len(cards) > limit
    data = [anthropic_model(c) for c in page]
    return {
        "data": data,
        "has_more": more,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


def visible(request: Request, cards: list[dict]) -> list[dict]:
    """The cards of the models the caller's key may use (a static key or an open server: all)."""
    key = caller_key(request)
    return cards if key is None else [c for c in cards if key.may_use(c["id"])]


class ModelsController(Controller):
    path = "/v1/models"

    @get("/")
    async def list_models(
        self,
        request: Request,
        models: NamedDependency[ModelRegistry],
        limit: FromQuery[int] = 20,
        after_id: FromQuery[str | None] = None,
        before_id: FromQuery[str | None] = None,
    ) -> Response:
        cards = visible(request, models.cards())
        if "anthropic-version" in request.headers:
            return json_response(anthropic_page(cards, limit, after_id, before_id))
        return json_response({"object": "list", "data": cards})

    @get("/{model_id:path}", responses=documented(None))
    async def get_model(
        self, request: Request, model_id: FromPath[str], models: NamedDependency[ModelRegistry]
    ) -> Response:
        name = model_id.lstrip("/")
        key = caller_key(request)
        if key is not None and not key.may_use(name):
            raise NotFound(
                f"the model `{name}` does not exist or this API key ({key.name}) may not use it",
                param="model",
                code="model_not_found",
            )
        card = models.card(name)
        return json_response(anthropic_model(card) if "anthropic-version" in request.headers else card)
