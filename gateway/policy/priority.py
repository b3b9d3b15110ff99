"""A request's priority (vLLM's field: an int, lower is more urgent, default 0) and who decides it.

``--scheduling-policy fcfs`` (the default) serves interactive requests in arrival order and refuses a
nonzero ``priority`` as vLLM does; ``priority`` orders admission's queue and each worker's
scheduler by it (gateway/policy/admission.py, worker/scheduler.py), and preemption takes the least urgent
first. A request without the field gets its managed key's ``default_priority`` when one is set
(the caller's record carries it: gateway/policy/caller.py), else 0. Whatever the policy, batch work (gateway/batches) runs at
``BATCH_PRIORITY``, below every interactive request: the batch runner marks its in-process calls
in the ASGI scope, which no client can reach, and the route's caller record says so (``Caller.batch``).
"""

from __future__ import annotations

from common.protocol import BATCH_PRIORITY
from gateway.errors import InvalidRequest
from gateway.policy.caller import Caller

POLICIES = ("fcfs", "priority")
LIMIT = BATCH_PRIORITY - 1  # |priority| a client may ask for
BATCH_SCOPE = "llmpool.batch"  # in the ASGI scope of the batch runner's calls: the batch's owner


def request_priority(caller: Caller | None, policy: str, asked: int | None, tier: str | None = None) -> int:
    """The priority a request runs at, from its field, its key's default and the policy (``policy``:
    --scheduling-policy). The gateway's own requests (no caller) run at 0. OpenAI's ``service_tier:
    flex`` (cheaper, slower) runs at the least urgent interactive priority under the priority policy."""
    if caller is None:
        return 0
    if caller.batch:
        return BATCH_PRIORITY
    if policy == "fcfs":
        if asked:
            raise InvalidRequest(
                "`priority` needs --scheduling-policy priority (this server serves requests first come, first served)",
                param="priority",
            )
        return 0
    if asked is None and tier == "flex":
        return LIMIT
    if asked is None:
        asked = caller.key.default_priority if caller.key is not None else 0
    if not -LIMIT <= asked <= LIMIT:
        raise InvalidRequest(f"`priority` must be between {-LIMIT} and {LIMIT}; got {asked}", param="priority")
    return asked
