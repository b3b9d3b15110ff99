"""Where an adapter's requests go (gateway/fleet/lora.py ``prefer``, through ``ModelPool.choose``): only to
workers that serve the adapter, and to one holding it resident unless it is much busier; and the
commands that bring each worker to the fleet's runtime adapters."""

from __future__ import annotations

import asyncio

from common.lora import LoraCommand, LoraInfo, LoraLoad, LoraResult
from common.protocol import Heartbeat, Ready
from gateway.fleet.lora import RESIDENT_SLACK_TOKENS, LoraCommands, preferring
from gateway.fleet.workers import ModelPool, WorkerInfo


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
    assert pool.choose(10, 0.0, preferring("a")) is warm
    assert pool.choose(10, 0.0) is not warm  # the base model's requests: the least busy
    warm.outstanding_tokens = RESIDENT_SLACK_TOKENS + 1
    assert pool.choose(10, 0.0, preferring("a")) is cold  # too busy: the adapter is read again elsewhere
    cold.outstanding_tokens = 10**6
    warm.outstanding_tokens = 10**6
    assert pool.choose(10, 0.0, preferring("a")) in (cold, warm)  # never the worker that does not serve it


def test_sync_brings_each_worker_to_the_fleets_runtime_adapters_once():
    """``LoraCommands.sync`` (each heartbeat): a worker missing a runtime load gets it, one holding an
    unloaded adapter drops it; a command in flight is not sent twice, a refused load not again."""
    sent: list[tuple[bytes, LoraCommand]] = []
    commands = LoraCommands(lambda identity, command: sent.append((identity, command)))
    commands.wanted = {"m": {"late": "/late", "gone": None}}
    joiner, current = worker("joiner", ["gone"], []), worker("current", ["late"], [])
    current.ready.lora.adapters["late"] = "/late"
    pools = {"m": pool_of(joiner, current)}
    asyncio.run(commands.sync(pools))
    assert sorted((i, c.name, c.path, c.unload) for i, c in sent) == [
        (b"joiner", "gone", "", True),
        (b"joiner", "late", "/late", False),
    ]
    asyncio.run(commands.sync(pools))
    assert len(sent) == 2, "unanswered commands are not sent again"
    for _, command in sent:
        error = "cannot read" if command.name == "late" else None
        commands.answered(joiner, LoraResult(command.token, command.name, error, command.path, command.unload))
    assert joiner.ready.lora.adapters == {}
    asyncio.run(commands.sync(pools))
    assert len(sent) == 2, "a load the worker refused is not retried while it stays registered"
