"""vLLM's token-in/token-out bodies (its ``vllm/entrypoints/serve/disagg`` protocol): what the render
endpoints answer and /inference/v1/generate takes, the generate response, and the derender bodies."""

from __future__ import annotations

import msgspec

from gateway.schemas.chat import SamplingOptions, StreamOptions


class GenerateSampling(SamplingOptions, kw_only=True):
    """vLLM's ``SamplingParams`` as JSON: the fields this server honours (others are ignored)."""

    max_tokens: int | None = 16  # vLLM's default
    n: int = 1
    stop: str | list[str] | None = None
    logprobs: int | None = None  # the sampled token's and the k most likely, as in vLLM


class GenerateRequest(msgspec.Struct, kw_only=True):
    """POST /inference/v1/generate: token ids in (a render endpoint's answer is one)."""

    token_ids: list[int]
    sampling_params: GenerateSampling = msgspec.field(default_factory=GenerateSampling)
    model: str | None = None
    request_id: str | None = None  # the id /abort_requests names; a fresh one when absent
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    priority: int = 0
    kv_transfer_params: dict | None = None  # disaggregated serving: passed back as it came
    features: dict | None = None  # multimodal features: refused (text-only models)


class GenerateChoice(msgspec.Struct, kw_only=True):
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: dict | None = None  # chat's shape; tokens named ``token_id:N`` as vLLM's tokens-only engine does


class GenerateResponse(msgspec.Struct, kw_only=True):
    request_id: str
    choices: list[GenerateChoice]
    prompt_logprobs: list | None = None
    kv_transfer_params: dict | None = None
    usage: dict | None = None


class DerenderChatRequest(msgspec.Struct, kw_only=True):
    """POST /v1/chat/completions/derender: a generate response back into a chat completion."""

    generate_response: GenerateResponse
    model: str | None = None
    prompt_tokens: int = 0
    chat_request: dict | None = None  # the chat request answered: its tools and thinking are read from the text


class DerenderCompletionRequest(msgspec.Struct, kw_only=True):
    """POST /v1/completions/derender: one generate response per prompt back into a text completion."""

    generate_responses: list[GenerateResponse]
    model: str | None = None
    prompt_tokens: list[int] | None = None


class AbortRequest(msgspec.Struct, kw_only=True):
    request_ids: list[str]
