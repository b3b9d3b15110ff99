"""Per-key limits of managed keys (gateway/state/keys.py), checked after a request's checks and
before its admission: the models a key may use (403), its monthly token budget (429
``insufficient_quota``), its generations in flight across the fleet (429), and its requests and
tokens per minute (429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, or Anthropic's
``anthropic-ratelimit-*`` under /v1/messages). Keys of ``--api-key`` and open servers have no limits.

The counts every gateway shares live in the state database (gateway/state/windows.py says how);
docs/keys-and-quotas.md says why the database rather than Redis.
"""

from __future__ import annotations

import math
import time

from gateway.errors import Overloaded, PermissionDenied, QuotaExceeded
from gateway.policy.admission import Admission
from gateway.policy.caller import Caller, RateInfo
from gateway.state.keys import KeyCache, KeyRecord, KeyStore
from gateway.state.usage import UsageMeter
from gateway.state.windows import Windows


class RateLimited(Overloaded):
    """Over a key's own limit (not the server's capacity)."""

    def __init__(self, message: str, rate: RateInfo | None = None, retry_after: float = 1.0) -> None:
        super().__init__(message, code="rate_limit_exceeded")
        self.rate = rate
        self.retry_after = retry_after

    def headers(self, anthropic: bool) -> dict[str, str]:
        out = {"Retry-After": str(max(1, math.ceil(self.retry_after)))}
        return {**out, **self.rate.headers(anthropic)} if self.rate is not None else out


class Quotas:
    def __init__(
        self, store: KeyStore, windows: Windows, admission: Admission, usage: UsageMeter, ttl_s: float
    ) -> None:
        self.store = store
        self.cache = KeyCache(store, ttl_s)
        self.windows = windows
        self.admission = admission
        self.usage = usage
        self._ids: dict[str, str] = {}  # owner -> key id, of the keys seen here
        usage.on_output = self._output

    async def check(self, key: KeyRecord, model: str, tokens: int, count: int) -> RateInfo | None:
        """Refuse the request of ``count`` generations and ``tokens`` prompt tokens if it is over
        one of ``key``'s limits; else count it in its minute and say what is left. ``model`` is the
        name the client asked for: a LoRA adapter's own, which a key must list to use it."""
        self._ids[key.owner] = key.id
        if not key.may_use(model):
            raise PermissionDenied(
                f"this API key ({key.name}) may not use the model `{model}`; it may use: {', '.join(key.models) or 'none'}",
                param="model",
                code="model_not_allowed",
            )
        if key.monthly_tokens is not None:
            spent = await self.windows.spent(key.owner, self.usage.pending_tokens(key.owner))
            if spent >= key.monthly_tokens:
                raise QuotaExceeded(
                    f"this API key ({key.name}) has used its monthly budget of {key.monthly_tokens} tokens "
                    f"({spent} used this month, UTC); it renews on the 1st",
                    code="insufficient_quota",
                )
        if key.max_concurrent is not None:
            running = self.admission.held[key.owner] + self.admission.queued(key.owner)
            running += self.windows.elsewhere.get(key.id, 0)
            if running + count > key.max_concurrent:
                raise RateLimited(
                    f"this API key ({key.name}) has {running} generations in flight and this request asks for "
                    f"{count} more; its limit is {key.max_concurrent} at a time"
                )
        if key.rpm is None and key.tpm is None:
            return None
        window = await self.windows.take(key.id, tokens, key.rpm, key.tpm)
        rate = RateInfo(key, window)
        if not window.admitted:
            over = "requests" if key.rpm is not None and window.requests >= key.rpm else "tokens"
            limit = key.rpm if over == "requests" else key.tpm
            raise RateLimited(
                f"this API key ({key.name}) is over its rate limit of {limit} {over} per minute; "
                f"retry after {max(1, math.ceil(window.reset_at - time.time()))} s",
                rate,
                window.reset_at - time.time(),
            )
        return rate

    def _output(self, owner: str, tokens: int) -> None:
        key_id = self._ids.get(owner)
        if key_id is not None:
            self.windows.add_output(key_id, tokens)

    async def enforce(self, caller: Caller | None, model: str, tokens: int, count: int) -> None:
        """``check`` for a request made with a managed key (nothing for other requests); the limits
        left go on the caller, for its answer's headers (gateway/http/auth.py's ``rate_headers``)."""
        if caller is None or caller.key is None:
            return
        rate = await self.check(caller.key, model, tokens, count)
        if rate is not None:
            caller.rate = rate

    async def sync(self) -> None:
        """The heartbeat's part (gateway/state/windows.py)."""
        inflight = {key_id: self.admission.held[owner] for owner, key_id in self._ids.items()}
        await self.windows.sync(inflight)
