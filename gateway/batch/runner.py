"""The batch runner: each gateway fills the pool's idle capacity with batch requests from the store.

Every tick (a heartbeat interval, or sooner when one of its requests ends) it checks the batches
still validating, gives back the claims of dead gateways, ends the batches with nothing left to run
(completed, expired, cancelled), and claims as many waiting requests as there is room for. Room is
idle capacity only: none while any interactive request waits for admission or any worker has
requests waiting for a place in its batch; otherwise up to ``--batch-max-inflight`` requests, and
no more than the places in the workers' batches that interactive requests leave free. Each request
runs through the app's own route (gateway/batch/lines.py) at the lowest priority, so a worker preempts
it first when interactive requests arrive (worker/scheduler.py) and recomputes it later.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from gateway.batch.lines import RETRY_STATUSES, call, error_line, output_line, parse_input, usage_of
from gateway.policy.admission import Admission
from gateway.state.batches import CANCELLED, EXPIRED, WAITING, Batches, Claimed
from gateway.state.file_store import ContentUnavailable
from gateway.state.files import Files

log = logging.getLogger(__name__)

MIN_TICK_S = 0.05  # at most this often, however fast requests end
RETRY_PAUSE_S = 1.0  # after a request had no worker or no room: claims wait this long


class BatchRunner:
    def __init__(
        self,
        app: Any,
        batches: Batches,
        files: Files,
        admission: Admission,
        workers: Callable[[], Iterable[Any]],
        interval: float,
        lease_s: float,
        max_inflight: int,
    ) -> None:
        """``workers``: the registered workers' records (gateway/fleet/workers.py WorkerInfo), for their load."""
        self.app = app
        self.batches = batches
        self.files = files
        self.admission = admission
        self.workers = workers
        self.interval = interval
        self.lease_s = lease_s
        self.max_inflight = max_inflight
        self.inflight: dict[asyncio.Task, Claimed] = {}
        self.done = 0  # requests whose line this gateway wrote, since start
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closing = False
        self._paused_until = 0.0

    def wake(self) -> None:
        """Look at the store now (a batch was created or cancelled here)."""
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def close(self) -> None:
        """Stop; the requests running here go back to waiting, for this or another gateway."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = list(self.inflight)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.tick()
            except Exception as exc:  # the database may be away a while: say so, try again
                log.warning("batch runner: %s", exc)
            await asyncio.sleep(MIN_TICK_S)

    def room(self) -> int:
        """How many more batch requests may run here now: idle capacity only."""
        if self.max_inflight <= 0 or self.admission.waiting or time.monotonic() < self._paused_until:
            return 0
        workers = list(self.workers())
        if not workers or any(w.load.waiting for w in workers):
            return 0
        places = sum(w.ready.max_batch_size for w in workers)
        interactive = max(0, self.admission.in_use - len(self.inflight))
        return max(0, min(self.max_inflight, places - interactive, self.admission.free) - len(self.inflight))

    async def tick(self) -> None:
        for batch_id, owner, file_id, endpoint in await self.batches.validating():
            await self._validate(batch_id, owner, file_id, endpoint)
        await self.batches.reclaim(self.lease_s)
        now = time.time()
        runnable = []
        for batch_id, owner, endpoint, status, expires_at in await self.batches.active():
            if status == "cancelling":
                await self.batches.stop_waiting(batch_id, CANCELLED)
                for task, claimed in list(self.inflight.items()):
                    if claimed.batch_id == batch_id:
                        task.cancel()
                if not await self.batches.unfinished(batch_id):
                    await self.batches.finalize(batch_id, "cancelled", self.lease_s)
                continue
            expired = now >= expires_at
            if expired and status == "in_progress":
                await self.batches.stop_waiting(batch_id, EXPIRED)
            if not await self.batches.unfinished(batch_id):
                await self.batches.finalize(batch_id, "expired" if expired else "completed", self.lease_s)
            elif status == "in_progress" and not expired:
                runnable.append((batch_id, owner, endpoint))
        for batch_id, owner, endpoint in runnable:  # the oldest batch first
            room = self.room()
            if room <= 0:
                break
            for claimed in await self.batches.claim(batch_id, owner, endpoint, room):
                task = asyncio.create_task(self._run(claimed), name=f"batch-{batch_id}-{claimed.line}")
                self.inflight[task] = claimed

    async def _validate(self, batch_id: str, owner: str, file_id: str, endpoint: str) -> None:
        try:
            content = await self.files.content(file_id, owner)
            gone = f"the input file {file_id} is gone"
        except ContentUnavailable as exc:
            content, gone = None, str(exc)
        if content is None:
            lines, model = [], None
            errors = [{"code": "invalid_file", "message": gone, "param": "input_file_id"}]
        else:
            lines, errors, model = await asyncio.to_thread(parse_input, content, endpoint)
        if await self.batches.start(batch_id, lines, errors, model):
            log.info(
                "batch %s: %s", batch_id, f"{len(errors)} problems in its input" if errors else f"{len(lines)} requests"
            )

    async def _run(self, claimed: Claimed) -> None:
        try:
            status, body, headers = await call(self.app, claimed.endpoint, claimed.body, claimed.owner)
            if status in RETRY_STATUSES:
                self._paused_until = time.monotonic() + RETRY_PAUSE_S
                await self.batches.release(claimed)
                return
            line = output_line(claimed.custom_id, status, body, headers)
            failed = status != 200
            if await self.batches.finish(claimed, line, failed, (0, 0, 0, 0) if failed else usage_of(body)):
                self.done += 1
        except asyncio.CancelledError:
            # Shutdown: back to waiting, for whichever gateway claims it next. Cancel: not run.
            await asyncio.shield(self.batches.release(claimed, WAITING if self._closing else CANCELLED))
            raise
        except Exception as exc:
            log.exception("batch %s line %d failed", claimed.batch_id, claimed.line)
            line = error_line(claimed.custom_id, "server_error", str(exc) or type(exc).__name__)
            await self.batches.finish(claimed, line, True, (0, 0, 0, 0))
        finally:
            self.inflight.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._wake.set()

    def snapshot(self) -> dict:
        return {"inflight": len(self.inflight), "done": self.done, "max_inflight": self.max_inflight}
