"""Work off the event loop, and work that stops when its client hangs up.

Tokenizing and template rendering take milliseconds each: ``Lanes`` runs them on threads, a lane
for small jobs and one for big inputs and requests' own templates, so a big job never holds up the
small ones. ``unless_disconnected`` cancels a non-streamed piece of work (a generation, an
admission wait, a template render) as soon as the client is gone: streams get that from Litestar.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from gateway.errors import ClientGone
from gateway.policy.caller import Caller

T = TypeVar("T")

SMALL_JOB_CHARS = 32_768  # inputs above this are tokenized in the big-job lane


class Lanes:
    """The threads that tokenize and render templates off the event loop, shared by every model.
    Big inputs and requests' own templates take their own lane, so they never hold up small ones."""

    def __init__(self, threads: int) -> None:
        self.small = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self.big = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-big")

    def close(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.big.shutdown(wait=False, cancel_futures=True)


async def unless_disconnected(caller: Caller | None, work: Awaitable[T]) -> T:
    """Run ``work`` but cancel it, which aborts it on the worker, as soon as the caller hangs up
    (a non-streamed generation, an admission wait, a request's own template); streams get this
    from Litestar, everything else needs it here. Without a caller's signal it just runs."""
    if caller is None or caller.disconnected is None:
        return await work
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(caller.disconnected())
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            gone = True
            task.cancel()  # only a request: wait until it took effect, and retrieve its outcome
            await asyncio.gather(task, return_exceptions=True)
    if gone:
        raise ClientGone("the client closed the connection; the request was aborted")
    return task.result()
