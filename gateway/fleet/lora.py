"""LoRA adapters at the gateway: which adapters each model's workers serve (their ``Ready``, kept
current by the answers to load and unload commands), and the commands themselves, sent to every
worker of the model and awaited (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

The adapters loaded and unloaded at runtime are the fleet's: recorded in the state database
(gateway/state/adapters.py) before any worker is told. Each heartbeat every gateway reads that record
and sends each worker the commands that bring it there (``LoraCommands.sync``): a worker that joins
or restarts gets the runtime adapters and drops the unloaded ones, and a gateway learns of a load
made through another one from the workers' answers (a worker that has the adapter answers at once).
Why not from the workers' own reports: a worker restarted with nothing knows nothing, so the
record has to live outside the workers anyway, and one way of learning it is enough.

A request names an adapter as its model; it runs on the base model's workers that serve the
adapter, preferring one that holds it resident (gateway/fleet/workers.py)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

from common.lora import LoraCommand, LoraInfo, LoraResult
from gateway.errors import GenerationFailed, InvalidRequest, NoWorkerAvailable
from gateway.state.adapters import LoraTable, Wanted

if TYPE_CHECKING:
    from gateway.fleet.workers import ModelPool, Narrow, WorkerInfo

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 120.0  # reading an adapter is quick; a worker that does not answer is stuck
RESIDENT_SLACK_TOKENS = 2048  # how much busier a worker holding the adapter may be and still be preferred


def adapters_of(pool: ModelPool) -> dict[str, str]:
    """The adapters some worker of the model serves: name -> folder."""
    found: dict[str, str] = {}
    for worker in pool.workers.values():
        if worker.ready.lora is not None:
            found.update(worker.ready.lora.adapters)
    return found


def serves(worker: WorkerInfo, name: str) -> bool:
    return worker.ready.lora is not None and name in worker.ready.lora.adapters


def prefer(available: list[WorkerInfo], name: str) -> list[WorkerInfo]:
    """The workers a request of adapter ``name`` may go to: those that serve it (all, if none says
    so: the worker then answers that it does not know it), narrowed to those holding it resident
    (no read from disk) unless they are more than RESIDENT_SLACK_TOKENS busier than the least busy."""
    serving = [w for w in available if serves(w, name)] or available
    resident = [w for w in serving if w.load.lora is not None and name in w.load.lora.resident]
    if not resident:
        return serving
    least = min(w.outstanding_tokens for w in serving)
    return [w for w in resident if w.outstanding_tokens <= least + RESIDENT_SLACK_TOKENS] or serving


def preferring(name: str) -> Narrow:
    """``ModelPool.choose``'s narrowing for a request of adapter ``name``."""
    return lambda available: prefer(available, name)


def find(models: dict[str, ModelPool], name: str) -> str | None:
    """The base model whose workers serve the adapter ``name`` (None: no such adapter)."""
    for model, pool in models.items():
        if any(serves(w, name) for w in pool.workers.values()):
            return model
    return None


class LoraCommands:
    """Sends load and unload commands, matches the workers' answers to them, and keeps every worker
    at the fleet's set of runtime adapters (``wanted``, read from ``table`` each heartbeat)."""

    def __init__(self, send: Callable[[bytes, LoraCommand], None]) -> None:
        self._send = send
        self._tokens = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[LoraResult]] = {}
        self._inflight: dict[int, tuple[bytes, str]] = {}  # token -> (worker, adapter) of every command unanswered
        self._failed: set[tuple[bytes, str, str]] = set()  # (worker, adapter, folder) sync could not load: not again
        self._lock = asyncio.Lock()  # a heartbeat's read of the record never overtakes a change made here
        self.table: LoraTable | None = None  # the fleet's record (None: this gateway's alone, as in socket tests)
        self.wanted: Wanted = {}  # model -> adapter -> folder (None: unloaded) of the runtime commands

    async def load(self, model: str, workers: list[WorkerInfo], name: str, path: str) -> None:
        """Record the load, then carry it out on ``workers`` (the record is put back if they refuse)."""
        before = self.wanted.get(model, {})
        had, previous = name in before, before.get(name)
        await self._record(model, name, path)
        try:
            await self.run(workers, name, path)
        except Exception:
            await self._record(model, name, previous, forget=not had)
            raise

    async def unload(self, model: str, workers: list[WorkerInfo], name: str) -> None:
        """Record the unload (it sticks: workers that come back with the adapter drop it), then carry it out."""
        await self._record(model, name, None)
        if workers:
            await self.run(workers, name, unload=True)

    async def _record(self, model: str, name: str, path: str | None, forget: bool = False) -> None:
        """Note the adapter's folder (None: unloaded), or no record of it at all (``forget``)."""
        async with self._lock:
            if forget:
                self.wanted.get(model, {}).pop(name, None)
            else:
                self.wanted.setdefault(model, {})[name] = path
            if self.table is not None:
                await (self.table.forget(model, name) if forget else self.table.record(model, name, path))

    async def run(self, workers: list[WorkerInfo], name: str, path: str = "", unload: bool = False) -> None:
        """Carry the command out on every worker given; raises InvalidRequest with the first
        worker's refusal (the adapter's fault: a bad folder, too high a rank)."""
        if not workers:
            raise NoWorkerAvailable("no worker is taking requests right now; retry shortly")
        loop = asyncio.get_running_loop()
        sent = [self._command(worker.identity, name, path, unload) for worker in workers]
        for token in sent:
            self._waiting[token] = loop.create_future()
        try:
            async with asyncio.timeout(COMMAND_TIMEOUT_S):
                results = await asyncio.gather(*(self._waiting[t] for t in sent))
        except TimeoutError:
            raise GenerationFailed(
                f"a worker did not answer the LoRA command for `{name}` in {COMMAND_TIMEOUT_S:.0f} s"
            )
        finally:
            for token in sent:
                self._waiting.pop(token, None)
        errors = [r.error for r in results if r.error is not None]
        if errors:
            raise InvalidRequest(errors[0], param="lora_path" if not unload else "lora_name")

    def _command(self, identity: bytes, name: str, path: str, unload: bool) -> int:
        token = next(self._tokens)
        self._inflight[token] = (identity, name)
        self._send(identity, LoraCommand(token, name, path, unload))
        return token

    async def sync(self, models: dict[str, ModelPool]) -> None:
        """The heartbeat's part: read the fleet's record, then send each worker what brings it there
        (one command per worker and adapter at a time; a load a worker refused is not sent again)."""
        async with self._lock:
            if self.table is not None:
                self.wanted = await self.table.wanted()
        workers = {w.identity: w for pool in models.values() for w in pool.workers.values()}
        self._failed = {f for f in self._failed if f[0] in workers}
        busy = set(self._inflight.values())
        for worker in workers.values():
            have = worker.ready.lora.adapters if worker.ready.lora is not None else None
            for name, path in self.wanted.get(worker.ready.model, {}).items():
                if have is None or (worker.identity, name) in busy or (worker.identity, name, path) in self._failed:
                    continue
                if path is None and name in have or path is not None and have.get(name) != path:
                    self._command(worker.identity, name, path or "", path is None)

    def answered(self, worker: WorkerInfo | None, result: LoraResult) -> None:
        """A worker's answer: its list of adapters follows it, and the command's waiter wakes."""
        self._inflight.pop(result.token, None)
        if worker is not None and result.error is None:
            info = worker.ready.lora or LoraInfo()
            adapters = dict(info.adapters)
            if result.unload:
                adapters.pop(result.name, None)
            else:
                adapters[result.name] = result.path
            worker.ready.lora = LoraInfo(adapters, info.max_loras)
        future = self._waiting.get(result.token)
        if future is not None and not future.done():
            future.set_result(result)
        elif worker is not None and result.error is not None:  # sync's command
            self._failed.add((worker.identity, result.name, result.path))
            log.warning("worker %s refused a LoRA command: %s", worker.ready.worker_name, result.error)


def lora_requests_info(workers: list[dict]) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info`` per worker that serves adapters (the Gateway API Inference
    Extension routes on it): the adapters of its running and of its waiting requests, comma-separated,
    and its ``max_lora``; the value is the time of the figures, as vLLM sets it."""
    gauge = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on LoRA requests",
        labels=["worker", "model", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    now = time.time()
    for w in workers:
        lora = w.get("lora")
        if lora:
            running, waiting = ",".join(lora["running"]), ",".join(lora["waiting"])
            gauge.add_metric([w["name"], w["model"], running, waiting, str(lora["max_loras"])], now)
    return gauge
