"""OpenAI request bodies as msgspec Structs: decoding checks the types, unknown fields are ignored."""

from __future__ import annotations

import re
from typing import TypeVar, Union

import msgspec

from gateway.errors import InvalidRequest

MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs (vLLM allows the same for legacy `logprobs`)


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: which call it answers


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by chat and legacy completions (each adds ``logprobs_count()``)."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    n: int = 1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    response_format: dict | None = None  # text, json_object or json_schema (guided decoding)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    chat_template: str | None = None  # refused unless --allow-request-chat-template
    chat_template_kwargs: dict | None = None  # more variables for the template (e.g. enable_thinking)
    tools: list | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprobs_count(self) -> int | None:
        """How many alternatives per token the worker reports (None: no logprobs at all)."""
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"`top_logprobs` must be between 0 and {MAX_LOGPROBS}; got {self.top_logprobs}", param="top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise InvalidRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
            return None
        return self.top_logprobs or 0


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Union[str, list]  # checked in the route: a string, strings, token ids or lists of them
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def logprobs_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"`logprobs` must be between 0 and {MAX_LOGPROBS}; got {self.logprobs}", param="logprobs")
        return self.logprobs


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: yes for a prompt, no for messages (the template has them)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


T = TypeVar("T")
_FIELD = re.compile(r"at `\$\.([^`]+)`|missing required field `([^`]+)`")


def decode_body(body: bytes, schema: type[T]) -> T:
    """Parse a JSON body into ``schema``; every problem becomes a 400 that names the field."""
    try:
        return msgspec.json.decode(body, type=schema)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _FIELD.search(text)
        param = (found.group(1) or found.group(2)) if found else None
        raise InvalidRequest(f"invalid request body: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:  # msgspec raises this for invalid UTF-8 inside strings
        raise InvalidRequest(f"the request body is not valid UTF-8: {exc.reason} at byte {exc.start}") from None
