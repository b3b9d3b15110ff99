"""The server's own rules for every request, from its flags, and the services that keep them: made
once at start (gateway/http/app.py) and held by each served model (gateway/generate/served_model.py),
so the core reads them there rather than from the web framework's application state."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.policy.quotas import Quotas
from gateway.state.usage import UsageMeter


@dataclass(slots=True, kw_only=True)
class Rules:
    scheduling_policy: str = "fcfs"  # --scheduling-policy (gateway/policy/priority.py)
    allow_request_chat_template: bool = False  # --allow-request-chat-template
    share_prefix_cache: bool = False  # --share-prefix-cache: every API key's prompts share cached blocks
    quotas: Quotas | None = None  # managed keys' limits (gateway/policy/quotas.py); None until the state store opens
    usage: UsageMeter | None = None  # tokens billed per key (gateway/state/usage.py)
