"""Reading what a peer sent when it does not decode as a whole: the parts that do, and why the rest
does not, so a worker can answer each request instead of dropping the message (worker/proc.py)."""

from __future__ import annotations

import msgspec

from common.protocol import PROTOCOL_VERSION, MsgType, NewRequest


def salvage_requests(frames: list[bytes] | list[memoryview]) -> tuple[list[NewRequest], list[tuple[str, str]]] | None:
    """An AddRequests that did not decode as a whole (say one prompt held ``true``), read request by
    request: the requests that decode, and (request id, why) for those that don't, so each can be
    answered instead of the whole message vanishing. None when the frames are not an AddRequests of
    this protocol version at all; a request without a readable id cannot be answered and is left out."""
    if len(frames) != 2 or bytes(frames[0]) != bytes((PROTOCOL_VERSION, MsgType.ADD_REQUESTS)):
        return None
    try:
        payload = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return None
    items = payload[0] if isinstance(payload, list) and payload else None  # AddRequests is [requests]
    if not isinstance(items, list):
        return None
    good: list[NewRequest] = []
    bad: list[tuple[str, str]] = []
    for item in items:
        try:
            good.append(msgspec.convert(item, NewRequest))
        except msgspec.ValidationError as exc:
            request_id = item[0] if isinstance(item, list) and item else None  # a NewRequest's id comes first
            if isinstance(request_id, str):
                bad.append((request_id, f"the worker could not read the request: {exc}"))
    return good, bad
