"""OpenAI's Responses API bodies (``client.responses.create``) as msgspec Structs, requests and
responses; the stream's events are these objects inside ``{"type", "sequence_number", ...}``."""

from __future__ import annotations

import msgspec

from gateway.schemas.chat import SamplingOptions


class InputPart(msgspec.Struct, kw_only=True):
    """A content part: ``input_text`` / ``output_text``, or ``input_image`` (``image_url``: a URL or
    data: URI; or ``file_id`` from the Files API) for an image-text model; files are refused."""

    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """One input item: a message (``type`` may be left out), a ``function_call`` the model made
    earlier, or the ``function_call_output`` that answers it."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputPart] | None = None
    id: str | None = None


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str  # text, json_object or json_schema: required (as OpenAI's), so it is always echoed
    name: str | None = None
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=lambda: TextFormat(type="text"))
    verbosity: str = "medium"  # accepted and ignored (docs/api/fields.md); echoed as OpenAI echoes it


class ResponsesRequest(SamplingOptions, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    store: bool = True
    previous_response_id: str | None = None
    stream: bool = False
    top_logprobs: int | None = None
    metadata: dict | None = None
    user: str | None = None
    # ``effort`` bounds a reasoning model's thinking (docs/reasoning.md); truncation is always
    # "disabled" (a prompt too long is a 400); include asks for extra fields we never have.
    reasoning: Reasoning | None = None
    thinking_token_budget: int | None = None  # vLLM's budget in tokens, as chat's (wins over reasoning.effort)
    truncation: str | None = None
    include: list[str] | None = None
    background: bool | None = None  # run detached from the connection; poll with GET, stop with POST .../cancel
    conversation: str | dict | None = None  # a conversation's id (or {"id": ...}): its items are the history
    max_tool_calls: int | None = None  # accepted and ignored
    stream_options: dict | None = None
    # Refused with a 400 naming it when set.
    prompt: dict | None = None


# ---- responses ----------------------------------------------------------------------------------


class Logprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict] = msgspec.field(default_factory=list)


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list = msgspec.field(default_factory=list)
    logprobs: list[Logprob] = msgspec.field(default_factory=list)


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: str  # in_progress, completed, incomplete
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningText(msgspec.Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """A reasoning model's thinking, as its text (no summary is made)."""

    id: str
    status: str
    content: list[ReasoningText]
    summary: list = msgspec.field(default_factory=list)


OutputItem = ReasoningItem | OutputMessage | FunctionCallItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # the openai SDK's type requires it; a prefix cache write is not billed apart


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str  # max_output_tokens


class ResponseError(msgspec.Struct):
    code: str
    message: str


class Reasoning(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None
    exclude: bool | None = None  # OpenRouter's: no reasoning item in the output
    max_tokens: int | None = None  # OpenRouter's: the thinking budget in tokens


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete, failed
    output: list[OutputItem]
    usage: ResponseUsage | None
    parallel_tool_calls: bool
    tool_choice: str | dict
    tools: list[FunctionTool]
    text: TextConfig
    store: bool
    object: str = "response"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict = msgspec.field(default_factory=dict)
    user: str | None = None
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    truncation: str = "disabled"
    background: bool = False
    conversation: dict | None = None  # {"id": ...} when it belongs to a conversation
    service_tier: str = "default"  # the request's, echoed as OpenAI does (auto: default)


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True
