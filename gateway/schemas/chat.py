"""OpenAI chat and completions bodies, requests and responses, as msgspec Structs: decoding checks the
types, unknown fields are ignored, and Litestar's OpenAPI document describes each one."""

from __future__ import annotations

from typing import Literal

import msgspec

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM allows the same for legacy `logprobs`)


class TextPart(msgspec.Struct):
    """A content part: ``text``, or ``image_url`` (``{"url": ..., "detail": ...}``) for an image-text model."""

    type: str
    text: str | None = None
    image_url: dict | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers
    reasoning_content: str | None = (
        None  # an assistant's earlier thinking (``reasoning`` too): templates that keep it read it
    )
    reasoning: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingOptions(msgspec.Struct, kw_only=True):
    """Sampling fields any dialect may carry (vLLM's extras included); the core reads only these."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    priority: int | None = (
        None  # vLLM's: lower is more urgent (--scheduling-policy priority); gateway/policy/priority.py
    )
    # Fields clients send on every endpoint (docs/api/fields.md): ``service_tier`` is echoed, and "flex"
    # runs at the lowest priority; the prompt-cache key steers routing; the rest are accepted and ignored.
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # 24h: blocks kept ahead of others
    provider: dict | None = None  # OpenRouter's provider routing


def echoed_tier(tier: str | None) -> str:
    """``service_tier`` as OpenAI's answers carry it: the tier asked for, ``auto`` (or none) as ``default``."""
    return "default" if tier in (None, "auto") else tier


class SamplingFields(SamplingOptions, kw_only=True):
    """Fields shared by chat and legacy completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    user: str | None = None
    response_format: dict | None = None  # text, json_object or json_schema (guided decoding)
    # vLLM's guided decoding (gateway/generate/structured_outputs.py): >= 0.12's one field, and the older ones
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    chat_template: str | None = None  # refused unless --allow-request-chat-template
    chat_template_kwargs: dict | None = None  # more variables for the template (e.g. enable_thinking)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    reasoning_effort: str | None = None  # a reasoning model's thinking budget by name (docs/reasoning.md)
    thinking_token_budget: int | None = None  # ... or in tokens (vLLM's name)
    # OpenRouter's reasoning object: ``effort`` and ``max_tokens`` bound the thinking, ``exclude`` hides it.
    reasoning: dict | None = None
    # OpenAI's, accepted and ignored (docs/api/fields.md).
    verbosity: str | None = None
    prediction: dict | None = None
    store: bool | None = (
        None  # OpenAI's; false here also means the stream is not logged, so it cannot resume (stream_runs.py)
    )
    metadata: dict | None = None
    modalities: list[str] | None = None
    web_search_options: dict | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list  # checked in the route: a string, strings, token ids or lists of them
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None
    store: bool | None = None  # false: the stream is not logged, so it cannot resume (stream_runs.py)


# ---- responses ----------------------------------------------------------------------------------


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True):
    """Every error, OpenAI's shape (gateway.errors builds it)."""

    error: ErrorDetail


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | msgspec.UnsetType = msgspec.UNSET  # a reasoning model's


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class AssistantMessage(msgspec.Struct, kw_only=True):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET
    # A reasoning model's thinking, under both names clients read (vLLM's older and newer).
    reasoning_content: str | msgspec.UnsetType = msgspec.UNSET
    reasoning: str | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: dict | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    service_tier: str = "default"  # the request's, echoed as OpenAI does (auto: default)


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed call: the first has ``id``, ``type`` and the name."""

    index: int
    function: FunctionCallDelta
    id: str | None = None
    type: str | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallChunk] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking, under both names
    reasoning: str | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: dict | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET  # null on every chunk when asked for, then the totals
    service_tier: str = "default"


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: dict | None
    finish_reason: str | None


class Completion(msgspec.Struct, kw_only=True):
    """A legacy completion, whole or one streamed chunk (the same object name for both, as OpenAI)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None | msgspec.UnsetType = msgspec.UNSET


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: yes for a prompt, no for messages (the template has them)
    add_generation_prompt: bool = True
    chat_template: str | None = None  # as chat's: refused unless --allow-request-chat-template
    chat_template_kwargs: dict | None = None
    tools: list | None = None  # rendered as chat renders them
    tool_choice: str | dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
