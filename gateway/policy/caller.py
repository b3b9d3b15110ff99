"""Who made a request, as the core needs to know it: the route builds a ``Caller`` from the HTTP
request (gateway/http/auth.py's ``caller_of``, through Litestar's dependency injection) and passes it
in, so nothing under generate/, fleet/ or policy/ knows the web framework. A request made by the
gateway itself (a response taken over from a dead gateway) has no caller.

``RateInfo`` is what a managed key's per-minute limits have left: quotas put it on the caller, and
the answer's headers carry it."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from gateway.state.keys import KeyRecord
from gateway.state.windows import Window


@dataclass(slots=True)
class RateInfo:
    """A key's per-minute limits and what is left of them, for the headers."""

    key: KeyRecord
    window: Window

    def headers(self, anthropic: bool) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` (reset as ``12s``), or
        Anthropic's ``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` (reset as RFC 3339)."""
        if anthropic:
            name = "anthropic-ratelimit-{what}-{field}"
            reset = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.window.reset_at))
        else:
            name = "x-ratelimit-{field}-{what}"
            reset = f"{max(0, math.ceil(self.window.reset_at - time.time()))}s"
        out = {}
        for what, limit, used in (
            ("requests", self.key.rpm, self.window.requests),
            ("tokens", self.key.tpm, self.window.tokens),
        ):
            if limit is not None:
                out[name.format(what=what, field="limit")] = str(limit)
                out[name.format(what=what, field="remaining")] = str(max(0, limit - used))
                out[name.format(what=what, field="reset")] = reset
        return out


@dataclass(slots=True, kw_only=True)
class Caller:
    """The caller of one request: its key, the headers that matter, its address, and a signal that
    it hung up."""

    owner: str = ""  # whose stored objects it sees and whose admission queue it waits in ('' on an open server)
    key: KeyRecord | None = None  # the managed key it came with: its limits and default priority
    batch: bool = False  # the batch runner's own call: it runs at BATCH_PRIORITY (gateway/policy/priority.py)
    request_id: str | None = None  # the client's X-Request-Id
    session_id: str | None = None  # the client's x-session-id: its requests' routing affinity
    address: str | None = None  # the client's host
    disconnected: Callable[[], Awaitable[None]] | None = None  # returns once the client has hung up
    rate: RateInfo | None = None  # set by quotas: its key's limits left, for the answer's headers
