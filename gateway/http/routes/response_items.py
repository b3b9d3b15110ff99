"""GET /v1/responses/{id}/input_items (paginated as OpenAI's) and POST /v1/responses/{id}/cancel
(a background response, wherever it runs: the gateway running it reads the request at its next
heartbeat)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath, FromQuery

from gateway.errors import InvalidRequest
from gateway.http.auth import caller_owner
from gateway.http.routes.common import RESPONSE, StateStore, documented, json_response
from gateway.schemas.responses import ResponseObject

CANCEL_WAIT_S = 10.0  # how long a cancel waits for another gateway to stop the response


class ItemList(msgspec.Struct):
    data: list[dict]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


def page(items: list[dict], limit: int, order: str, after: str | None, param: str = "after") -> ItemList:
    """OpenAI's cursor pages: ``order`` asc or desc, at most ``limit`` (1-100) after the item ``after``."""
    if not 1 <= limit <= 100:
        raise InvalidRequest(f"`limit` must be between 1 and 100; got {limit}", param="limit")
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise InvalidRequest(f"no item with id {after!r} here", param=param)
        ordered = ordered[ids.index(after) + 1 :]
    data = ordered[:limit]
    return ItemList(data, data[0]["id"] if data else None, data[-1]["id"] if data else None, len(ordered) > limit)


class ResponseItemsController(Controller):
    path = "/"

    @get(
        ["/v1/responses/{response_id:str}/input_items", "/responses/{response_id:str}/input_items"],
        responses=documented(ItemList, "its input items"),
    )
    async def input_items(
        self,
        request: Request,
        stored: StateStore,
        response_id: FromPath[str],
        limit: FromQuery[int] = 20,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
        after: FromQuery[str | None] = None,
    ) -> Response:
        found = (
            await stored.store.input_items(response_id, caller_owner(request))
            if response_id.startswith("resp_")
            else None
        )
        items = RESPONSE.found(found, response_id)  # another dialect's logged stream (stream_runs.py) is not a response
        return json_response(page(items, limit, order, after))

    @post(
        ["/v1/responses/{response_id:str}/cancel", "/responses/{response_id:str}/cancel"],
        status_code=200,
        responses=documented(ResponseObject, "the response, cancelled"),
    )
    async def cancel(self, request: Request, stored: StateStore, response_id: FromPath[str]) -> Response:
        owner, state = caller_owner(request), stored
        found = RESPONSE.found(
            await state.store.get(response_id, owner) if response_id.startswith("resp_") else None, response_id
        )
        if not found.background:
            raise InvalidRequest("Only background responses can be cancelled", param="response_id")
        if found.running:
            if state.runs.cancel(response_id):
                await state.runs.wait(response_id)
            else:
                await state.leases.request_cancel(response_id, owner)
                deadline = time.monotonic() + CANCEL_WAIT_S
                while found is not None and found.running and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    found = await state.store.get(response_id, owner)
            found = await state.store.get(response_id, owner) or found
        return Response(content=found.body, media_type="application/json")
