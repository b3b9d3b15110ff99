"""The pool's figures in /metrics, read from the latest heartbeats when Prometheus scrapes: which
workers are registered and their states, the pool's totals and admission's, and one family per
heartbeat figure with a sample per worker (``PER_WORKER``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.fleet.lora import lora_requests_info
from gateway.policy.admission import Admission


class PoolCollector(Collector):
    """Per-worker gauges from the latest heartbeats, read when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], dict], admission: Admission) -> None:
        self.snapshot = snapshot
        self.admission = admission

    def collect(self) -> Iterator:
        snapshot = self.snapshot()
        workers = snapshot["workers"]
        yield from presence(workers, snapshot["departed"])
        yield from self.totals(snapshot)
        yield from per_worker(workers)

    def totals(self, snapshot: dict) -> Iterator:
        """Figures of the whole pool, and of this gateway's admission."""
        workers = snapshot["workers"]
        yield CounterMetricFamily(
            "llmpool_worker_departures",
            "Worker registrations dropped (left, died, unreachable, or replaced when it re-registered)",
            value=snapshot["departures"],
        )
        yield GaugeMetricFamily(
            "llmpool_queue_length", "Requests waiting on all workers", value=sum(w["waiting"] for w in workers)
        )
        yield GaugeMetricFamily(
            "llmpool_running_batch_size", "Sequences running on all workers", value=sum(w["running"] for w in workers)
        )
        yield GaugeMetricFamily(
            "llmpool_inflight_requests", "Requests the gateway is waiting on", value=snapshot["inflight"]
        )
        yield GaugeMetricFamily(
            "llmpool_gateway_queued_requests", "Requests queued for an admission slot", value=self.admission.waiting
        )
        yield CounterMetricFamily(
            "llmpool_gateway_rejected_requests", "Requests refused with 429", value=self.admission.rejected
        )
        yield CounterMetricFamily(
            "llmpool_gateway_pushed_out_requests",
            "Of those, waiters that gave their place to another API key's request (fair admission)",
            value=self.admission.pushed_out,
        )
        yield CounterMetricFamily(
            "llmpool_kv_store_routed_requests",
            "Requests sent away from their prefix's worker to a less loaded one that reads the prefix from a KV store they share",
            value=snapshot["store_routed"],
        )
        yield CounterMetricFamily(
            "llmpool_resumed_requests", "Requests moved to another worker after theirs died", value=snapshot["resumed"]
        )


def presence(workers: list[dict], departed: list[dict]) -> Iterator:
    """Which workers are registered, which were dropped lately, and the workers by state."""
    info = GaugeMetricFamily(
        "llmpool_worker_info", "A registered worker (value 1)", labels=["worker", "device", "dtype", "model"]
    )
    up = GaugeMetricFamily(
        "llmpool_worker_up", "1 for a registered worker, 0 for a recently dropped one", labels=["worker", "model"]
    )
    for w in workers:
        info.add_metric([w["name"], w["device"], w["dtype"], w["model"]], 1)
        up.add_metric([w["name"], w["model"]], 1)
    live = {(w["name"], w["model"]) for w in workers}
    gone = {(d["name"], d["model"]) for d in departed} - live  # recently dropped and not back
    for name, model in gone:
        up.add_metric([name, model], 0)
    yield info
    yield up
    yield lora_requests_info(workers)
    states = GaugeMetricFamily("llmpool_workers", "Workers by state", labels=["state"])
    draining = sum(1 for w in workers if w["draining"])
    busy = sum(1 for w in workers if not w["draining"] and (w["running"] or w["waiting"]))
    states.add_metric(["draining"], draining)
    states.add_metric(["busy"], busy)
    states.add_metric(["ready"], len(workers) - busy - draining)
    states.add_metric(["dead"], len(gone))  # now, not how often: a worker that rejoined is not dead
    yield states


def per_worker(workers: list[dict]) -> Iterator:
    """One family per heartbeat figure (PER_WORKER), a sample per worker (the KV store's only for
    workers that have one)."""
    for kind, name, text, value, store_only in PER_WORKER:
        family = kind(name, text, labels=["worker", "model"])
        for w in workers:
            if not store_only or w["kv_store_id"]:
                family.add_metric([w["name"], w["model"]], value(w))
        yield family


# Per-worker KV store counters (worker/kv_store): heartbeat field -> (metric name, help).
KV_STORE_COUNTERS = {
    "kv_store_hits": ("llmpool_worker_kv_store_hit_blocks", "KV blocks loaded from the KV store instead of computed"),
    "kv_store_misses": (
        "llmpool_worker_kv_store_miss_blocks",
        "KV blocks looked up in the KV store and not found (computed)",
    ),
    "kv_store_read_bytes": ("llmpool_worker_kv_store_read_bytes", "Bytes read from the KV store"),
    "kv_store_written_bytes": ("llmpool_worker_kv_store_written_bytes", "Bytes written to the KV store"),
    "kv_store_read_seconds": (
        "llmpool_worker_kv_store_read_seconds",
        "Time spent reading from the KV store (read speed: bytes / seconds)",
    ),
    "kv_store_evictions": (
        "llmpool_worker_kv_store_evictions",
        "KV blocks evicted from the store to keep its size bound (Redis: the server's evictions)",
    ),
}


def _field(name: str) -> Callable[[dict], Any]:
    return lambda w: w[name]


# Per-worker figures from the heartbeats: (family, metric name, help, value from a worker's record,
# only for workers with a KV store).
PER_WORKER: tuple = (
    (GaugeMetricFamily, "llmpool_worker_running", "Sequences in the worker's running batch", _field("running"), False),
    (GaugeMetricFamily, "llmpool_worker_waiting", "Requests queued on the worker", _field("waiting"), False),
    (
        GaugeMetricFamily,
        "llmpool_worker_kv_cache_usage_ratio",
        "Share of KV blocks in use",
        lambda w: 1 - w["free_blocks"] / w["total_blocks"] if w["total_blocks"] else 0.0,
        False,
    ),
    (
        GaugeMetricFamily,
        "llmpool_worker_tokens_per_second",
        "Tokens generated per second, last 10 s",
        _field("tokens_per_s"),
        False,
    ),
    (
        GaugeMetricFamily,
        "llmpool_worker_peak_batch_size",
        "Largest batch the worker has run",
        _field("peak_batch_size"),
        False,
    ),
    (
        GaugeMetricFamily,
        "llmpool_worker_draining",
        "1 while the worker finishes its requests before leaving",
        lambda w: int(w["draining"]),
        False,
    ),
    (
        GaugeMetricFamily,
        "llmpool_worker_kv_store_size_bytes",
        "Bytes in the worker's KV store, as it last measured (a shared store: every worker's)",
        _field("kv_store_size_bytes"),
        True,
    ),
    (
        GaugeMetricFamily,
        "llmpool_worker_capacity_tokens_per_second",
        "Tokens per second of busy step time (what routing weighs outstanding work by)",
        _field("capacity_tokens_per_s"),
        False,
    ),
    (
        CounterMetricFamily,
        "llmpool_worker_prefix_cache_hit_tokens",
        "Prompt tokens served from the prefix cache",
        _field("prefix_hit_tokens"),
        False,
    ),
    (
        CounterMetricFamily,
        "llmpool_worker_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        _field("prefix_queried_tokens"),
        False,
    ),
    (
        CounterMetricFamily,
        "llmpool_worker_preemptions",
        "Requests preempted for lack of KV blocks",
        _field("preemptions"),
        False,
    ),
    (CounterMetricFamily, "llmpool_worker_steps", "Engine steps run", _field("steps"), False),
    (
        CounterMetricFamily,
        "llmpool_worker_spec_proposed_tokens",
        "Speculative decoding: draft tokens proposed",
        _field("spec_proposed_tokens"),
        False,
    ),
    (
        CounterMetricFamily,
        "llmpool_worker_spec_accepted_tokens",
        "Speculative decoding: draft tokens accepted (acceptance rate: accepted / proposed)",
        _field("spec_accepted_tokens"),
        False,
    ),
    *((CounterMetricFamily, name, text, _field(field), True) for field, (name, text) in KV_STORE_COUNTERS.items()),
)
