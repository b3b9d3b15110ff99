"""A batch's lines in and out: the input file checked line by line (OpenAI's rules), one request
run through the gateway's own routes in-process, and its output line in OpenAI's format.

Running a line through the app itself (an ASGI call, no socket) means a batch request takes exactly
the path an interactive one does: the dialect's body checks, the generation core, admission,
dispatch; its answer is the very body and status a client would get. The call's ASGI scope carries
the batch's owner (gateway/policy/priority.py ``BATCH_SCOPE``): that is what makes it batch work, at the
lowest priority and billed to the key that created the batch; no client can set a scope key.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from gateway.policy.priority import BATCH_SCOPE
from gateway.state.files import new_id

MAX_LINES = 50_000  # OpenAI's limit per batch
MAX_ERRORS = 20  # problems reported of a bad input file
RETRY_STATUSES = (429, 503)  # no room or no worker now: the request runs again later


def parse_input(content: bytes, endpoint: str) -> tuple[list[tuple[str, bytes]], list[dict], str | None]:
    """(custom_id, body as JSON) per line, the problems found (OpenAI's ``errors.data`` items), and
    the model the lines name (the first one's)."""
    lines: list[tuple[str, bytes]] = []
    errors: list[dict] = []
    seen: set[str] = set()
    model = None

    def problem(number: int, code: str, message: str, param: str | None = None) -> None:
        if len(errors) < MAX_ERRORS:
            errors.append({"code": code, "message": message, "param": param, "line": number})

    for number, raw in enumerate(content.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            item = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            problem(number, "invalid_json_line", f"line {number} is not JSON: {exc}")
            continue
        if not isinstance(item, dict):
            problem(number, "invalid_request", f"line {number} must be a JSON object")
            continue
        custom_id, body = item.get("custom_id"), item.get("body")
        if not isinstance(custom_id, str) or not custom_id:
            problem(number, "missing_required_parameter", "`custom_id` must be a non-empty string", "custom_id")
        elif custom_id in seen:
            problem(number, "duplicate_custom_id", f"`custom_id` {custom_id!r} is used by an earlier line", "custom_id")
        elif item.get("method") != "POST":
            problem(number, "invalid_method", f"`method` must be POST; got {item.get('method')!r}", "method")
        elif item.get("url") != endpoint:
            problem(number, "mismatched_endpoint", f"`url` must be the batch's endpoint {endpoint}", "url")
        elif not isinstance(body, dict):
            problem(number, "invalid_request", "`body` must be a JSON object", "body")
        elif body.get("stream"):
            problem(number, "invalid_request", "`body.stream` must be false in a batch", "body.stream")
        else:
            seen.add(custom_id)
            model = model or body.get("model")
            lines.append((custom_id, msgspec.json.encode(body)))
    if not lines and not errors:
        problem(0, "empty_file", "the input file holds no requests")
    if len(lines) > MAX_LINES:
        problem(0, "too_many_requests", f"a batch holds at most {MAX_LINES} requests; this file has {len(lines)}")
    return lines, errors, model if isinstance(model, str) else None


async def call(app: Any, path: str, body: bytes, owner: str) -> tuple[int, bytes, dict[str, str]]:
    """POST ``body`` to ``path`` on the app itself, as batch work of ``owner``: (status, body, headers)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {},
        BATCH_SCOPE: owner,
    }
    delivered = False
    status, headers, chunks = 500, {}, []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never disconnects: cancelling the call is how it stops
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers.update((k.decode().lower(), v.decode()) for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks), headers


def output_line(custom_id: str, status: int, body: bytes, headers: dict[str, str]) -> bytes:
    """One line of the output (or error) file, OpenAI's shape."""
    try:
        decoded = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError:
        decoded = {"error": {"message": body.decode(errors="replace"), "type": "server_error"}}
    return msgspec.json.encode(
        {
            "id": new_id("batch_req_"),
            "custom_id": custom_id,
            "response": {
                "status_code": status,
                "request_id": headers.get("x-request-id") or new_id("req_"),
                "body": decoded,
            },
            "error": None,
        }
    )


def error_line(custom_id: str, code: str, message: str) -> bytes:
    """A line whose request never got an answer."""
    line = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return msgspec.json.encode(line)


def usage_of(body: bytes) -> tuple[int, int, int, int]:
    """(input, cached, output, reasoning) tokens from an answer's ``usage``, in any of the dialects' shapes."""
    try:
        usage = (msgspec.json.decode(body) or {}).get("usage") or {}
    except (msgspec.DecodeError, AttributeError):
        return (0, 0, 0, 0)
    details_in = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    details_out = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    return (
        int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0),
        int(details_in.get("cached_tokens", 0) or 0),
        int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0),
        int(details_out.get("reasoning_tokens", 0) or 0),
    )
