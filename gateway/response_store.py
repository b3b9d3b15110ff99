"""Stored responses of the Responses API (``store``, on by default as OpenAI's is): a bounded
in-memory LRU, so ``previous_response_id`` can continue a conversation and GET / DELETE work.
The oldest entries go first when it is full; a gateway restart forgets them all."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_STORED_RESPONSES = 1024


@dataclass(slots=True)
class StoredResponse:
    body: Any  # the response object as GET returns it
    conversation: list[dict]  # the messages so far, its own output included (instructions are not carried)


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
