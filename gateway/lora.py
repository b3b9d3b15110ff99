"""LoRA adapters at the gateway: which adapters each model's workers serve (their ``Ready``, kept
current by the answers to load and unload commands), and the commands themselves, sent to every
worker of the model and awaited (vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

A request names an adapter as its model; it runs on the base model's workers that serve the
adapter, preferring one that holds it resident (gateway/pool.py)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily

from common.lora import LoraCommand, LoraInfo, LoraResult
from gateway.errors import GenerationFailed, InvalidRequest, NoWorkerAvailable

if TYPE_CHECKING:  # gateway/pool.py imports this module
    from common.protocol import NewRequest
    from gateway.pool import ModelPool, RequestStream, WorkerInfo
    from gateway.worker_client import WorkerClient

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


def find(models: dict[str, ModelPool], name: str) -> str | None:
    """The base model whose workers serve the adapter ``name`` (None: no such adapter)."""
    for model, pool in models.items():
        if any(serves(w, name) for w in pool.workers.values()):
            return model
    return None


class LoraCommands:
    """Sends load and unload commands and matches the workers' answers to them."""

    def __init__(self, send: Callable[[bytes, LoraCommand], None]) -> None:
        self._send = send
        self._tokens = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[LoraResult]] = {}

    async def run(self, workers: list[WorkerInfo], name: str, path: str = "", unload: bool = False) -> None:
        """Carry the command out on every worker given; raises InvalidRequest with the first
        worker's refusal (the adapter's fault: a bad folder, too high a rank)."""
        if not workers:
            raise NoWorkerAvailable("no worker is taking requests right now; retry shortly")
        sent = []
        loop = asyncio.get_running_loop()
        for worker in workers:
            token = next(self._tokens)
            self._waiting[token] = loop.create_future()
            self._send(worker.identity, LoraCommand(token, name, path, unload))
            sent.append(token)
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

    def answered(self, worker: WorkerInfo | None, result: LoraResult) -> None:
        """A worker's answer: its list of adapters follows it, and the command's waiter wakes."""
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


class AdapterClient:
    """The worker client as a generator of the adapter ``name`` sees it: every request it submits
    runs with the adapter (``NewRequest.lora``); everything else is the base model's client."""

    def __init__(self, client: WorkerClient, name: str) -> None:
        self._client = client
        self.lora = name

    def submit(self, request: NewRequest, *args: object, **kwargs: object) -> RequestStream:
        """``WorkerClient.submit``, the request carrying the adapter."""
        request.lora = self.lora
        return self._client.submit(request, *args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self._client, name)


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
