"""A step that fails: find the rows that make it fail, and keep the results of all the others.

The batch runs again in halves, a failing half in halves again, until a failing part is a single
row: that request is the culprit. Every other row's token comes from a part that ran cleanly.
Rerunning is safe for the cache: a step writes only the slots of the tokens it computes, beyond each
request's computed (and prefix-cached) blocks, so a part that runs again rewrites the same slots,
and a culprit's blocks are freed with it. If every row fails alone, the fault is the step's, not a
request's: the first error is raised again (the engine then fails them all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from worker.scheduler import RunOutput, ScheduledBatch

log = logging.getLogger(__name__)


def run_isolating(
    execute: Callable[[ScheduledBatch], RunOutput], batch: ScheduledBatch
) -> tuple[RunOutput, dict[str, Exception]]:
    """``execute(batch)``; if it raises, the results of the rows that run cleanly and each culprit's error."""
    try:
        return execute(batch), {}
    except Exception as exc:  # one request's bad state must not fail the others
        first = exc
    log.warning(
        "step of %d requests failed (%s: %s); rerunning it in parts to find the request at fault",
        len(batch),
        type(first).__name__,
        first,
    )
    result = RunOutput()
    culprits: dict[str, Exception] = {}
    parts = halves(batch) if len(batch) > 1 else []
    if not parts:
        culprits[batch.requests[0].request_id] = first
    while parts:
        part = parts.pop()
        try:
            result.update(execute(part))
        except Exception as part_exc:  # narrowing down to the failing row
            if len(part) == 1:
                culprits[part.requests[0].request_id] = part_exc
            else:
                parts.extend(halves(part))
    if len(culprits) == len(batch):
        raise first
    return result, culprits


def halves(batch: ScheduledBatch) -> list[ScheduledBatch]:
    """Split a batch into two (the first half last, so it runs first off a stack)."""
    middle = len(batch) // 2
    return [batch.subset(range(middle, len(batch))), batch.subset(range(middle))]
