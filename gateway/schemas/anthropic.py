"""Anthropic's Messages API bodies (the ``anthropic`` SDK, Claude Code) as msgspec Structs."""

from __future__ import annotations

import msgspec

from gateway.schemas.chat import SamplingOptions


class ContentBlock(msgspec.Struct, kw_only=True):
    """A content block: ``text``, ``tool_use`` (an assistant's call), ``tool_result`` (its answer),
    ``thinking`` (an assistant's earlier thinking, ``reasoning_content`` to the template), ``image``
    (``source``: base64 or url) for an image-text model; documents refused."""

    type: str
    text: str | None = None
    thinking: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None
    source: dict | None = None  # an image block's: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    cache_control: dict | None = None  # a cache breakpoint: {"type": "ephemeral", "ttl": "5m" | "1h"}


class AnthropicMessage(msgspec.Struct, kw_only=True):
    role: str  # user or assistant
    content: str | list[ContentBlock]


class SystemBlock(msgspec.Struct, kw_only=True):
    type: str
    text: str
    cache_control: dict | None = None


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict | None = None
    type: str | None = None  # None or "custom": a client tool; Anthropic's server tools are refused
    cache_control: dict | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: str  # auto, any, tool, none
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    """``enabled`` with ``budget_tokens`` (the worker ends the thinking there), ``disabled`` (no
    thinking: a budget of 0), ``adaptive`` (no budget)."""

    type: str
    budget_tokens: int | None = None


class CountTokensRequest(SamplingOptions, kw_only=True):
    """The prompt part of a request (sampling fields are accepted so a whole request counts too)."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[SystemBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None  # a reasoning model's thinking budget
    cache_control: dict | None = None  # automatic caching: a breakpoint on the last cacheable block


class MessagesRequest(CountTokensRequest, kw_only=True):
    """temperature / top_p / top_k come from SamplingOptions (current SDKs send them as extra body
    fields); Anthropic's default temperature is 1.0, as is ours."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    metadata: dict | None = None
    store: bool | None = None  # ours: false and the stream is not logged, so it cannot resume (stream_runs.py)
    # Anthropic's, accepted and ignored (docs/api/fields.md).
    container: str | dict | None = None
    mcp_servers: list | None = None
    context_management: dict | None = None


# ---- responses ----------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, kw_only=True, tag="thinking", tag_field="type"):
    thinking: str
    signature: str = ""  # nothing to verify: the thinking comes back as the template reads it


class ToolUseBlock(msgspec.Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict


class AnthropicUsage(msgspec.Struct, kw_only=True):
    input_tokens: int  # prompt tokens not read from the cache
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    content: list[ThinkingBlock | TextBlock | ToolUseBlock]
    stop_reason: str | None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: str | None
    usage: AnthropicUsage
    type: str = "message"
    role: str = "assistant"


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class AnthropicErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct, kw_only=True):
    """Every error under /v1/messages, Anthropic's shape (gateway.errors builds it)."""

    error: AnthropicErrorDetail
    type: str = "error"
