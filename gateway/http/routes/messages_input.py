"""Anthropic's Messages body as the generation core's request: ``system`` and the messages (text,
``tool_use``, ``tool_result`` and ``thinking`` blocks) become chat messages for the chat template;
tools with ``input_schema`` become function tools, ``tool_choice`` auto / any / tool / none maps onto
auto / required / named / none, and ``thinking.budget_tokens`` bounds a reasoning model's thinking.
``image`` blocks (base64 or url sources) become image parts (gateway/generate/vision.py).
A pure translation: documents and server tools are 400s naming the field."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.generate.request import CoreRequest
from gateway.generate.vision import image_part, parts_content
from gateway.http.routes.conversation_checks import ToolCallLedger, not_empty, required_text
from gateway.schemas.anthropic import AnthropicMessage, ContentBlock, CountTokensRequest, MessagesRequest, SystemBlock
from gateway.schemas.chat import SamplingOptions

_SKIPPED = ("redacted_thinking",)


def _text(blocks: str | list[ContentBlock] | None, param: str) -> str:
    """Text blocks' text (a tool result's content, a system prompt); anything else is a 400."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, block in enumerate(blocks):
        if block.type != "text" or block.text is None:
            raise InvalidRequest(
                f"`{param}[{j}]` is a {block.type} block; only text is supported here", param=f"{param}[{j}]"
            )
    return "".join(block.text for block in blocks)  # type: ignore[misc]


def chat_messages(system: str | list[SystemBlock] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """The conversation as chat messages: tool results become tool messages, tool uses an
    assistant's tool calls. As Anthropic's API: every message but a final assistant one has content,
    a ``tool_use`` has its ``id`` and ``name``, a ``tool_result`` answers an earlier ``tool_use``."""
    if not messages:
        raise InvalidRequest("`messages` must hold at least one message", param="messages")
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system if isinstance(system, str) else _system_text(system)})
    calls = ToolCallLedger()
    for i, message in enumerate(messages):
        if message.role not in ("user", "assistant"):
            raise InvalidRequest(
                f"`messages[{i}].role` must be user or assistant; got {message.role!r}", param=f"messages[{i}].role"
            )
        if message.role == "user" or i < len(messages) - 1:
            not_empty(message.content, f"messages[{i}].content")
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        parts: list[dict[str, Any]] = []
        tool_calls, thinking = [], ""
        for j, block in enumerate(message.content):
            param = f"messages[{i}].content[{j}]"
            if block.type == "text":
                parts.append({"type": "text", "text": block.text or ""})
            elif block.type == "image" and message.role == "user":
                parts.append(_image(block, param))
            elif block.type == "thinking":  # earlier thinking: for the templates that keep it
                thinking += block.thinking or ""
            elif block.type == "tool_use" and message.role == "assistant":
                tool_calls.append(_tool_call(block, param, calls))
            elif block.type == "tool_result" and message.role == "user":
                out.append(_tool_message(block, param, calls))
            elif block.type not in _SKIPPED:
                raise InvalidRequest(
                    f"`{param}`: {block.type} blocks are not supported in a {message.role} message on this server",
                    param=param,
                )
        text = parts_content(parts)
        if text or tool_calls or message.role == "assistant":
            extra = {"tool_calls": tool_calls} if tool_calls else {}
            out.append(
                {
                    "role": message.role,
                    "content": text,
                    **extra,
                    **({"reasoning_content": thinking} if thinking else {}),
                }
            )
    return out


def _image(block: ContentBlock, param: str) -> dict[str, Any]:
    """An ``image`` block: its base64 source as a data: URI, or its url (fetched by the core's rules)."""
    source = block.source or {}
    if source.get("type") == "base64" and isinstance(source.get("data"), str):
        return image_part(
            f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}", f"{param}.source.data"
        )
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return image_part(source["url"], f"{param}.source.url")
    raise InvalidRequest(f"`{param}.source` must be a base64 or url image source", param=f"{param}.source")


def _tool_call(block: ContentBlock, param: str, calls: ToolCallLedger) -> dict[str, Any]:
    """An assistant's ``tool_use`` block as a chat tool call."""
    calls.call(block.id, f"{param}.id")
    arguments = orjson.dumps(block.input or {}).decode()
    function = {"name": required_text(block.name, f"{param}.name"), "arguments": arguments}
    return {"id": block.id, "type": "function", "function": function}


def _tool_message(block: ContentBlock, param: str, calls: ToolCallLedger) -> dict[str, Any]:
    """A user's ``tool_result`` block as a tool message, answering an earlier ``tool_use``."""
    calls.result(block.tool_use_id, f"{param}.tool_use_id", "tool_use")
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content, f"{param}.content")}


def _system_text(blocks: list[SystemBlock]) -> str:
    for k, block in enumerate(blocks):
        if block.type != "text":
            raise InvalidRequest(f"`system[{k}].type` must be text; got {block.type!r}", param=f"system[{k}].type")
    return "\n".join(block.text for block in blocks)


def core_request(req: CountTokensRequest) -> CoreRequest:
    """The body in the core's terms; only the Messages dialect's own shapes are checked here. A
    count_tokens body brings no budget, stops or sampling settings to check."""
    functions, choice, parallel = _tools(req)
    whole = isinstance(req, MessagesRequest)
    return CoreRequest(
        sampling=req if whole else SamplingOptions(),
        messages=chat_messages(req.system, req.messages),
        max_tokens=req.max_tokens if whole else None,
        stop=req.stop_sequences if whole else None,
        stop_param="stop_sequences",
        tools=functions,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        tool_name_param="tools[{}].name",
        reasoning_budget=_thinking_budget(req),
        budget_param="thinking.budget_tokens",
    )


def _thinking_budget(req: CountTokensRequest) -> int | None:
    """``thinking`` as a budget: enabled's own, none for disabled (0), none at all for adaptive."""
    thinking = req.thinking
    if thinking is None or thinking.type == "adaptive":
        return None
    if thinking.type == "disabled":
        return 0
    if thinking.type != "enabled" or thinking.budget_tokens is None:
        raise InvalidRequest(
            '`thinking` must be {"type": "enabled", "budget_tokens": N}, disabled or adaptive', param="thinking"
        )
    return thinking.budget_tokens


def _tools(req: CountTokensRequest) -> tuple[list[dict], str | dict | None, bool | None]:
    """Tools with ``input_schema`` as function tools; tool_choice auto / any / tool / none as auto /
    required / named / none (Anthropic's server tools are a 400)."""
    functions = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(
                f"`tools[{i}].type` {tool.type!r} is a server tool, which this server does not run",
                param=f"tools[{i}].type",
            )
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        functions.append({"type": "function", "function": function})
    choice, parallel = req.tool_choice, None
    mode: str | dict | None = None
    if choice is not None:
        parallel = False if choice.disable_parallel_tool_use else None
        modes: dict[str, str | dict] = {
            "auto": "auto",
            "any": "required",
            "none": "none",
            "tool": {"type": "function", "function": {"name": choice.name}},
        }
        if choice.type not in modes:
            raise InvalidRequest(
                f"`tool_choice.type` must be auto, any, tool or none; got {choice.type!r}", param="tool_choice.type"
            )
        mode = modes[choice.type]
    return functions, mode, parallel
