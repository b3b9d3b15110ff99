"""The state store as the app holds it, and its one background task: the lease, cancel requests,
takeover of dead gateways' background responses, the usage flush and the purge."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from gateway.state.aborts import Aborts
from gateway.state.leases import Leases
from gateway.state.runs import Runs
from gateway.state.store import Limits, StateStore
from gateway.state.usage import UsageMeter

log = logging.getLogger(__name__)

ABANDONED_S = 600.0  # a plain stream of a dead gateway that nobody resumed this long is dropped
# Continue a response a dead gateway was running: (response id, the dead gateway) -> started here or not.
TakeOver = Callable[[str, str], Awaitable[bool]]


class StateService:
    def __init__(
        self, store: StateStore, usage: UsageMeter, interval: float, lease_s: float, purge_interval: float
    ) -> None:
        self.store = store
        self.usage = usage
        self.runs = Runs()
        self.leases = Leases(store.db, store.gateway_id, lease_s)
        self.aborts = Aborts(store.db)
        self.interval = interval
        self.purge_interval = purge_interval
        self.take_over: TakeOver | None = None
        self.hooks: list[Callable[[], Awaitable[None]]] = []  # more work of each beat (gateway.policy.quotas' sync)
        self._task: asyncio.Task | None = None

    @classmethod
    async def open(
        cls, url: str, limits: Limits, usage: UsageMeter, interval: float, lease_s: float, purge_interval: float
    ) -> StateService:
        service = cls(await StateStore.open(url, limits), usage, interval, lease_s, purge_interval)
        await service.leases.renew()
        return service

    def start(self, take_over: TakeOver) -> None:
        self.take_over = take_over
        self._task = asyncio.create_task(self._loop(), name="state-heartbeat")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.runs.stop()
        try:
            await self.usage.flush(self.store.db)
        finally:
            await self.store.close()

    async def _loop(self) -> None:
        next_purge = time.monotonic() + min(self.purge_interval, 5.0)
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.tick(purge=time.monotonic() >= next_purge)
            except Exception as exc:  # the database may be away a while: say so, try again next beat
                log.warning("state store heartbeat failed: %s", exc)
            if time.monotonic() >= next_purge:
                next_purge = time.monotonic() + self.purge_interval

    async def tick(self, purge: bool = False) -> None:
        await self.leases.renew()
        for response_id in await self.leases.cancel_requests():
            self.runs.cancel(response_id)
        if self.take_over is not None:
            for response_id, gateway in await self.leases.orphans():
                if self.runs.get(response_id) is None:
                    await self.take_over(response_id, gateway)
        await self.usage.flush(self.store.db)
        for hook in self.hooks:
            await hook()
        if purge:
            counts = await self.store.purge()
            await self.leases.forget_dead()
            abandoned = await self.leases.abandoned(ABANDONED_S)
            if abandoned:
                await self.store.delete_ids(abandoned)
            if any(counts.values()):
                log.info(
                    "state store purge: %d expired, %d evicted over --state-max-bytes",
                    counts["expired"],
                    counts["evicted"],
                )
