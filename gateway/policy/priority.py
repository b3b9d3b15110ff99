"""A request's priority (vLLM's field: an int, lower is more urgent, default 0) and who decides it.

``--scheduling-policy fcfs`` (the default) serves interactive requests in arrival order and refuses a
nonzero ``priority`` as vLLM does; ``priority`` orders admission's queue and each worker's
scheduler by it (gateway/policy/admission.py, worker/scheduler.py), and preemption takes the least urgent
first. A request without the field gets its managed key's ``default_priority`` when one is set
(gateway/policy/auth.py puts the key's record on the request), else 0. Whatever the policy, batch work (gateway/batches) runs at
``BATCH_PRIORITY``, below every interactive request: the batch runner marks its in-process calls
in the ASGI scope, which no client can reach.
"""

from __future__ import annotations

from litestar.connection import ASGIConnection

from common.protocol import BATCH_PRIORITY
from gateway.errors import InvalidRequest

POLICIES = ("fcfs", "priority")
LIMIT = BATCH_PRIORITY - 1  # |priority| a client may ask for
BATCH_SCOPE = "llmpool.batch"  # in the ASGI scope of the batch runner's calls: the batch's owner


def batch_owner(connection: ASGIConnection) -> str | None:
    """The owner of the batch this call runs for, when the batch runner made it (else None)."""
    return connection.scope.get(BATCH_SCOPE)  # type: ignore[return-value]


def request_priority(connection: ASGIConnection | None, asked: int | None) -> int:
    """The priority a request runs at, from its field, its key's default and the policy."""
    if connection is None:
        return 0
    if batch_owner(connection) is not None:
        return BATCH_PRIORITY
    state = connection.app.state
    policy = getattr(state, "scheduling_policy", "fcfs")
    if policy == "fcfs":
        if asked:
            raise InvalidRequest(
                "`priority` needs --scheduling-policy priority (this server serves requests first come, first served)",
                param="priority",
            )
        return 0
    if asked is None:
        key = connection.scope.get("state", {}).get("api_key")  # a managed key's record (gateway/policy/auth.py)
        asked = getattr(key, "default_priority", None) or 0
    if not -LIMIT <= asked <= LIMIT:
        raise InvalidRequest(f"`priority` must be between {-LIMIT} and {LIMIT}; got {asked}", param="priority")
    return asked
