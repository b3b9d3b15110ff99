"""The core's request: what a dialect translated its body into, before any check (``core.start``
checks it); and the id it runs under (``request_id``: the client's X-Request-Id, or a fresh one)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.protocol import RequestOutput
from gateway.schemas.chat import SamplingOptions


@dataclass(slots=True, kw_only=True)
class CoreRequest:
    """One request in the core's terms, as a dialect translated it; nothing in it is checked yet.
    The ``*_param`` fields name where a dialect keeps a field, for the errors."""

    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    # The prompt: a conversation (messages as chat templates read them, rendered with the tools),
    # or prompts given as text (tokenized as they are) or as token ids.
    messages: list[dict] | None = None
    prompts: list[str | list[int]] = field(default_factory=list)
    template: str | None = None  # the request's own chat template (refused unless the server allows them)
    template_kwargs: dict | None = None  # more variables for the template
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # for text prompts
    max_tokens: int | None = None  # None: all the room left in the context
    max_tokens_param: str = "max_tokens"
    stop: str | list[str] | None = None
    stop_param: str = "stop"
    response_format: dict | None = None  # {"type": text | json_object | json_schema, "schema", "strict"}
    format_param: str = "response_format"
    tools: list | None = None  # function tools in OpenAI chat's shape
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    tool_name_param: str = "tools[{}].function.name"
    reasoning_effort: str | None = None  # a reasoning model's thinking budget by name (gateway/generate/reasoning.py)
    reasoning_budget: int | None = None  # ... or in tokens; either way the worker ends the thinking there
    effort_param: str = "reasoning_effort"
    budget_param: str = "thinking_token_budget"
    n: int = 1  # generations per prompt
    n_param: str = "n"  # ``best_of`` in legacy completions
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    logprobs_param: str = "logprobs"
    prompt_logprobs: int | None = None
    request_id: str | None = None  # None: the client's X-Request-Id (made unique), or a fresh one
    # A response taken over from a gateway that died (n = 1): the worker outputs it had delivered,
    # replayed through the same pipeline before the rest is generated; and each new output as it
    # comes (so it can be logged for the next takeover).
    replay: list[RequestOutput] = field(default_factory=list)
    on_output: Callable[[RequestOutput], None] | None = None
    # Usage metering (gateway.state.usage): set from the request by ``start`` unless given here.
    owner: str | None = None
    meter: Any = None
    priority: int = 0  # set by ``start`` (gateway/policy/priority.py): admission's and the workers' order
    # Completed by ``start``: the prefix-cache salt (the caller's key's, and the request's own under it;
    # None: shared), and the routing affinity key (``prompt_cache_key``, else ``x-session-id``).
    cache_salt: str | None = None
    affinity_key: str | None = None
    retain_s: float = 0.0  # retention asked for (Anthropic's ttl; ``prompt_cache_retention: 24h``, read by ``start``)

    def span_attributes(self, model: str, prompts: list[list[int]]) -> dict[str, Any]:
        """OpenTelemetry's GenAI request attributes (gateway/ops/tracing.py puts them on the request span)."""
        sampling = self.sampling
        attributes: dict[str, Any] = {
            "gen_ai.request.model": model,
            "gen_ai.response.model": model,
            "gen_ai.request.choice.count": self.n,
            "gen_ai.usage.input_tokens": sum(len(p) for p in prompts),
            "llmpool.request_id": self.request_id,
        }
        optional = {
            "gen_ai.request.max_tokens": self.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.request.seed": sampling.seed,
            "gen_ai.request.presence_penalty": sampling.presence_penalty,
            "gen_ai.request.frequency_penalty": sampling.frequency_penalty,
            "gen_ai.request.stop_sequences": ([self.stop] if isinstance(self.stop, str) else self.stop) or None,
            "gen_ai.request.stream": getattr(sampling, "stream", None),
        }
        attributes.update({k: v for k, v in optional.items() if v is not None})
        return attributes


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def request_id(header: str | None) -> str:
    """The client's X-Request-Id when it is a sane token, else a fresh one; it follows the request
    into the worker (it is the wire request id) and comes back in the response's X-Request-Id."""
    if header and _REQUEST_ID.fullmatch(header):
        return f"{header}-{uuid.uuid4().hex[:8]}"  # unique even when a client reuses its id
    return uuid.uuid4().hex
