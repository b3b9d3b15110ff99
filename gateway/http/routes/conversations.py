"""The Conversations API (``client.conversations``, the Agents SDK's ``OpenAIConversationsSession``):
a conversation and its items, scoped to the caller's key (another key's is a 404).

POST /v1/conversations, GET / POST (metadata) / DELETE /v1/conversations/{id}, and
POST / GET /v1/conversations/{id}/items, GET / DELETE /v1/conversations/{id}/items/{item_id}.
A response created with ``conversation`` continues it and adds its items (``gateway.http.routes.responses``).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody

from gateway.errors import InvalidRequest, NotFound
from gateway.http.auth import caller_owner
from gateway.http.routes.common import CONVERSATION, StateStore, documented, json_response
from gateway.http.routes.response_items import ItemList, page
from gateway.http.routes.response_runs import input_items
from gateway.schemas.responses import InputItem
from gateway.state.conversations import MAX_ITEMS_AT_ONCE
from gateway.state.limits import check_metadata


class ConversationBody(msgspec.Struct, kw_only=True):
    items: list[InputItem] | None = None
    metadata: dict | None = None


class ItemsBody(msgspec.Struct, kw_only=True):
    items: list[InputItem]


class Conversation(msgspec.Struct):
    id: str
    created_at: int
    metadata: dict
    object: str = "conversation"


class DeletedConversation(msgspec.Struct):
    id: str
    object: str = "conversation.deleted"
    deleted: bool = True


def _items(items: list[InputItem] | None) -> list[dict]:
    if items is not None and len(items) > MAX_ITEMS_AT_ONCE:
        raise InvalidRequest(
            f"`items` may hold at most {MAX_ITEMS_AT_ONCE} items at once; got {len(items)}", param="items"
        )
    return input_items(items) if items else []


def conversation_id(conversation: str | dict | None) -> str | None:
    """The conversation a response names: its id, or {"id": ...}."""
    if conversation is None or isinstance(conversation, str):
        return conversation
    if not isinstance(conversation.get("id"), str):
        raise InvalidRequest('`conversation` must be a conversation\'s id or {"id": ...}', param="conversation")
    return conversation["id"]


class ConversationsController(Controller):
    path = "/v1/conversations"

    @post("/", status_code=200, responses=documented(Conversation, "the conversation"))
    async def create(self, request: Request, stored: StateStore, data: JSONBody[ConversationBody]) -> Response:
        metadata = check_metadata(data.metadata)
        return json_response(
            await stored.store.conversations.create(caller_owner(request), metadata, _items(data.items))
        )

    @get("/{conversation_id:str}", responses=documented(Conversation, "the conversation"))
    async def retrieve(self, request: Request, stored: StateStore, conversation_id: FromPath[str]) -> Response:
        found = CONVERSATION.found(
            await stored.store.conversations.get(conversation_id, caller_owner(request)), conversation_id
        )
        return json_response(found)

    @post(
        "/{conversation_id:str}",
        status_code=200,
        responses=documented(Conversation, "the conversation, its metadata replaced"),
    )
    async def update(
        self, request: Request, stored: StateStore, conversation_id: FromPath[str], data: JSONBody[dict[str, Any]]
    ) -> Response:
        metadata = check_metadata(data.get("metadata"))
        found = await stored.store.conversations.update(conversation_id, caller_owner(request), metadata)
        return json_response(CONVERSATION.found(found, conversation_id))

    @delete(
        "/{conversation_id:str}", status_code=200, responses=documented(DeletedConversation, "the conversation is gone")
    )
    async def remove(self, request: Request, stored: StateStore, conversation_id: FromPath[str]) -> Response:
        CONVERSATION.found(
            await stored.store.conversations.delete(conversation_id, caller_owner(request)), conversation_id
        )
        return json_response(DeletedConversation(conversation_id))

    @post("/{conversation_id:str}/items", status_code=200, responses=documented(ItemList, "the items added"))
    async def add_items(
        self, request: Request, stored: StateStore, conversation_id: FromPath[str], data: JSONBody[ItemsBody]
    ) -> Response:
        added = CONVERSATION.found(
            await stored.store.conversations.add(conversation_id, caller_owner(request), _items(data.items)),
            conversation_id,
        )
        return json_response(page(added, max(1, min(len(added), 100)), "asc", None))

    @get("/{conversation_id:str}/items", responses=documented(ItemList, "its items"))
    async def list_items(
        self,
        request: Request,
        stored: StateStore,
        conversation_id: FromPath[str],
        limit: FromQuery[int] = 20,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
        after: FromQuery[str | None] = None,
    ) -> Response:
        items = CONVERSATION.found(
            await stored.store.conversations.items(conversation_id, caller_owner(request)), conversation_id
        )
        return json_response(page(items, limit, order, after))

    @get("/{conversation_id:str}/items/{item_id:str}", responses=documented(None, "the item"))
    async def retrieve_item(
        self, request: Request, stored: StateStore, conversation_id: FromPath[str], item_id: FromPath[str]
    ) -> Response:
        item = await stored.store.conversations.item(conversation_id, caller_owner(request), item_id)
        if item is None:
            raise NotFound(
                f"No item {item_id!r} in conversation {conversation_id!r}", param="item_id", code="not_found"
            )
        return json_response(item)

    @delete(
        "/{conversation_id:str}/items/{item_id:str}",
        status_code=200,
        responses=documented(Conversation, "the conversation"),
    )
    async def remove_item(
        self, request: Request, stored: StateStore, conversation_id: FromPath[str], item_id: FromPath[str]
    ) -> Response:
        store, owner = stored.store.conversations, caller_owner(request)
        if not await store.delete_item(conversation_id, owner, item_id):
            raise NotFound(
                f"No item {item_id!r} in conversation {conversation_id!r}", param="item_id", code="not_found"
            )
        return json_response(await store.get(conversation_id, owner))
