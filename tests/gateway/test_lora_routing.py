"""Where an adapter's requests go (gateway/lora.py ``prefer``, through ``ModelPool.choose``): only to
workers that serve the adapter, and to one holding it resident unless it is much busier."""

from __future__ import annotations

from common.lora import LoraInfo, LoraLoad
from common.protocol import Heartbeat, Ready
from gateway.lora import RESIDENT_SLACK_TOKENS
from gateway.pool import ModelPool, WorkerInfo


def worker(name: str, adapters: list[str], resident: list[str], outstanding: int = 0) -> WorkerInfo:
    ready = Ready(name, "m", 1024, 4096, 16, 8, "cpu", "float32", lora=LoraInfo({a: f"/{a}" for a in adapters}, 2))
    info = WorkerInfo(name.encode(), ready, 0.0, load=Heartbeat(lora=LoraLoad(resident=resident, max_loras=2)))
    info.outstanding_tokens = outstanding
    return info


def pool_of(*workers: WorkerInfo) -> ModelPool:
    pool = ModelPool("m")
    pool.workers = {w.identity: w for w in workers}
    return pool


def test_an_adapters_request_goes_where_the_adapter_is_resident_unless_that_worker_is_much_busier():
    cold = worker("cold", ["a"], [])
    warm = worker("warm", ["a"], ["a"], outstanding=RESIDENT_SLACK_TOKENS)
    stranger = worker("stranger", [], [])  # does not serve `a` at all
    pool = pool_of(cold, warm, stranger)
    assert pool.choose(10, 0.0, "a") is warm
    assert pool.choose(10, 0.0) is not warm  # the base model's requests: the least busy
    warm.outstanding_tokens = RESIDENT_SLACK_TOKENS + 1
    assert pool.choose(10, 0.0, "a") is cold  # too busy: the adapter is read again elsewhere
    cold.outstanding_tokens = 10**6
    warm.outstanding_tokens = 10**6
    assert pool.choose(10, 0.0, "a") in (cold, warm)  # never the worker that does not serve it
