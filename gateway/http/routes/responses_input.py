"""The Responses body's translation into the generation core's terms: ``input`` (a string, or
message / function_call / function_call_output items, after a stored conversation's) into chat
messages, and the request's settings into one ``CoreRequest``; what the core does not do is
refused here with a 400 naming the field (gateway/http/routes/responses.py lists what).
"""

from __future__ import annotations

import base64
from typing import Any

import msgspec

from gateway.errors import InvalidRequest
from gateway.generate.request import CoreRequest
from gateway.generate.vision import image_part, parts_content
from gateway.http.routes.conversation_checks import ToolCallLedger, json_arguments, not_empty, required_text
from gateway.schemas.responses import (
    InputItem,
    InputPart,
    ResponsesRequest,
)
from gateway.state.files import Files
from gateway.state.limits import check_metadata, check_user

_TEXT_PARTS = ("input_text", "output_text", "text")


FILE_URL = "llmpool-file:"  # an input_image's file_id, until the route reads the file (``inline_files``)


def _text(content: str | list[InputPart] | None, param: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A content field's text: a string, or text parts, with ``images`` also input_image parts
    (anything else is a 400 naming it)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if images and part.type == "input_image" and (part.image_url or part.file_id):
            where = f"{param}[{j}].image_url" if part.image_url else f"{param}[{j}].file_id"
            parts.append(image_part(part.image_url or FILE_URL + str(part.file_id), where))
        elif part.type not in _TEXT_PARTS or part.text is None:
            raise InvalidRequest(
                f"`{param}[{j}]` is a {part.type} part; only text is supported here", param=f"{param}[{j}]"
            )
        else:
            parts.append({"type": "text", "text": part.text})
    return parts_content(parts)


async def inline_files(messages: list[dict[str, Any]], files: Files | None, owner: str) -> None:
    """Each input_image given by ``file_id``: the file's bytes (the Files API's) as a data: URI (a
    400 if no such file)."""
    for part in (p for m in messages if isinstance(m["content"], list) for p in m["content"]):
        if part.get("type") == "image" and part["url"].startswith(FILE_URL):
            data = None if files is None else await files.content(part["url"].removeprefix(FILE_URL), owner)
            if data is None:
                raise InvalidRequest(f"`{part['param']}`: no such file", param=part["param"])
            part["url"] = "data:image/*;base64," + base64.b64encode(data).decode()


def input_messages(items: str | list[InputItem], history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """The input as chat messages: consecutive function calls join one assistant message. A
    ``function_call_output`` must answer a call made earlier (in ``history`` or the input), a
    ``function_call``'s arguments must be JSON, and a message must have content."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    calls = ToolCallLedger(history)
    for i, item in enumerate(items):
        if item.type == "message":
            if item.role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(
                    f"`input[{i}].role` must be user, assistant, system or developer; got {item.role!r}",
                    param=f"input[{i}].role",
                )
            if item.role == "user":
                not_empty(item.content, f"input[{i}].content")
            content = _text(item.content, f"input[{i}].content", images=item.role == "user")
            messages.append({"role": item.role, "content": content})
        elif item.type == "function_call":
            calls.call(item.call_id, f"input[{i}].call_id")
            name = required_text(item.name, f"input[{i}].name")
            arguments = json_arguments(item.arguments, f"input[{i}].arguments")
            call = {"id": item.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            calls.result(item.call_id, f"input[{i}].call_id", "function_call")
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, f"input[{i}].output")}
            )
        elif item.type == "reasoning":
            continue  # another model's reasoning: nothing here reads it
        else:
            raise InvalidRequest(
                f"`input[{i}].type` {item.type!r} is not supported (message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    if not messages:
        raise InvalidRequest("`input` must hold at least one item", param="input")
    return messages


def core_request(req: ResponsesRequest, conversation: list[dict[str, Any]]) -> CoreRequest:
    """The body in the core's terms, ``conversation`` being the chat messages of the history and
    the input; only the Responses dialect's own shapes are checked here (the rest of the body's in
    ``refuse_unsupported``, before the history is read)."""
    functions = []
    for i, tool in enumerate(
        req.tools or []
    ):  # in chat's shape, without null fields (the template and the Hermes prompt want none)
        if tool.type != "function":
            raise InvalidRequest(
                f"`tools[{i}].type` {tool.type!r} is not supported: only function tools are", param=f"tools[{i}].type"
            )
        function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
        functions.append(
            {"type": "function", "function": {k: v for k, v in function.items() if k != "description" or v is not None}}
        )
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise InvalidRequest(
                '`tool_choice` must be none, auto, required or {"type": "function", "name": ...}', param="tool_choice"
            )
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    return CoreRequest(
        sampling=req,
        messages=system + conversation,
        max_tokens=req.max_output_tokens,
        max_tokens_param="max_output_tokens",
        response_format=msgspec.structs.asdict(req.text.format) if req.text else None,
        format_param="text.format",
        tools=functions,
        tool_choice=choice,
        parallel_tool_calls=req.parallel_tool_calls,
        tool_name_param="tools[{}].name",
        logprobs=req.top_logprobs,
        logprobs_param="top_logprobs",
        reasoning_effort=req.reasoning.effort if req.reasoning else None,
        effort_param="reasoning.effort",
        reasoning_budget=req.thinking_token_budget or (req.reasoning.max_tokens if req.reasoning else None),
    )


def refuse_unsupported(req: ResponsesRequest) -> None:
    if req.prompt:
        raise InvalidRequest("`prompt` is not supported by this server", param="prompt")
    if req.conversation is not None and req.previous_response_id is not None:
        raise InvalidRequest("`conversation` and `previous_response_id` cannot both be given", param="conversation")
    if req.background and not req.store:
        raise InvalidRequest("`background` responses must be stored: send `store: true`", param="background")
    check_metadata(req.metadata)
    check_user(req.user)
