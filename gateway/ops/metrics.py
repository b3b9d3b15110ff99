"""GET /metrics in Prometheus format: request outcomes, latency histograms, and the pool's state.

Latencies are recorded by the generation pipeline as tokens pass through; per-worker figures
(batch, queue, KV usage, prefix-cache hits) are read from the workers' latest heartbeats at scrape
time. prometheus_client does the exposition format and histogram buckets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.protocol import RequestOutput
from gateway.fleet.lora import lora_requests_info
from gateway.policy.admission import Admission

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
KNOWN_PATHS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready", "/workers", "/metrics"}


class Metrics:
    """The gateway's own registry (not the process-global one), so several apps can live in one process."""

    def __init__(self, snapshot: Callable[[], dict], admission: Admission) -> None:
        """``snapshot``: the pool as /workers shows it (``WorkerClient.snapshot``), read at each scrape."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.http_requests = Counter(
            "llmpool_http_requests", "HTTP responses by path and status", ["path", "status"], registry=r
        )
        model = ["model"]
        self.generations = Counter(
            "llmpool_generations",
            "Finished generations by model and outcome (stop, length, error, cancelled)",
            ["model", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "llmpool_prompt_tokens", "Prompt tokens of finished generations", model, registry=r
        )
        self.generation_tokens = Counter("llmpool_generation_tokens", "Generated tokens", model, registry=r)
        self.ttft = Histogram(
            "llmpool_time_to_first_token_seconds", "Submit to first token", model, buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "llmpool_inter_token_latency_seconds",
            "Gap between tokens, per token",
            model,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "llmpool_e2e_request_latency_seconds", "Submit to last token", model, buckets=LATENCY_BUCKETS, registry=r
        )
        lane = ["lane"]  # small, or big: inputs over SMALL_JOB_CHARS and requests' own templates
        self.tokenize_jobs = Gauge(
            "llmpool_gateway_tokenize_jobs", "Tokenizing and template jobs queued or running, by lane", lane, registry=r
        )
        self.tokenize_jobs_ended = Counter(
            "llmpool_gateway_tokenize_jobs_ended",
            "Tokenizing and template jobs ended, by lane and outcome (done, error, deadline, cancelled: its client left)",
            ["lane", "outcome"],
            registry=r,
        )
        r.register(PoolCollector(snapshot, admission))

    def track_job(self, lane: str, job: Future, stopped: Callable[[], str | None]) -> None:
        """Count ``job`` as queued or running in ``lane`` until it ends, then its outcome: a backlog
        of big jobs, or templates that run to their deadline, show here first (and tests wait on it).
        ``stopped`` says why a template's budget stopped it, if it did."""
        self.tokenize_jobs.labels(lane).inc()

        def ended(done: Future) -> None:
            self.tokenize_jobs.labels(lane).dec()
            outcome = "cancelled" if done.cancelled() else stopped() or ("error" if done.exception() else "done")
            self.tokenize_jobs_ended.labels(lane, outcome).inc()

        job.add_done_callback(ended)

    def path_label(self, path: str) -> str:
        return path if path in KNOWN_PATHS else "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestClock:
    """Feeds one request's latencies and outcome to the metrics (and one log line) as tokens arrive."""

    def __init__(self, metrics: Metrics, request_id: str, model: str) -> None:
        self.metrics = metrics
        self.request_id = request_id
        self.model = model
        self.ttft = None
        self.submitted = self.last = time.perf_counter()
        self.first_seen = False
        self.outcome = "cancelled"  # unless a finish or an error says otherwise
        self.prompt_tokens = self.generated = 0

    def tokens(self, item: RequestOutput) -> None:
        count = len(item.new_token_ids)
        self.prompt_tokens, self.generated = item.num_prompt_tokens, item.num_output_tokens
        if not count:
            return
        now = time.perf_counter()
        if not self.first_seen:
            self.first_seen = True
            self.ttft = now - self.submitted
            self.metrics.ttft.labels(self.model).observe(self.ttft)
        else:
            gap = (now - self.last) / count  # several tokens in one message share the gap
            itl = self.metrics.itl.labels(self.model)
            for _ in range(count):
                itl.observe(gap)
        self.last = now

    def done(self) -> None:
        elapsed = time.perf_counter() - self.submitted
        log.info(
            "request %s (%s) %s: %d prompt + %d generated tokens, first token %s, %.0f ms",
            self.request_id,
            self.model,
            self.outcome,
            self.prompt_tokens,
            self.generated,
            "-" if self.ttft is None else f"{self.ttft * 1000:.0f} ms",
            elapsed * 1000,
            extra={
                "request_id": self.request_id,
                "model": self.model,
                "outcome": self.outcome,
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.generated,
                "ttft_s": self.ttft,
                "duration_s": round(elapsed, 4),
            },
        )
        self.metrics.e2e.labels(self.model).observe(elapsed)
        self.metrics.generations.labels(self.model, self.outcome).inc()
        self.metrics.prompt_tokens.labels(self.model).inc(self.prompt_tokens)
        self.metrics.generation_tokens.labels(self.model).inc(self.generated)


class PoolCollector(Collector):
    """Per-worker gauges from the latest heartbeats, read when Prometheus scrapes."""

    def __init__(self, snapshot: Callable[[], dict], admission: Admission) -> None:
        self.snapshot = snapshot
        self.admission = admission

    def collect(self) -> Iterator:
        snapshot = self.snapshot()
        workers = snapshot["workers"]
        gauges = {
            "running": GaugeMetricFamily(
                "llmpool_worker_running", "Sequences in the worker's running batch", labels=["worker", "model"]
            ),
            "waiting": GaugeMetricFamily(
                "llmpool_worker_waiting", "Requests queued on the worker", labels=["worker", "model"]
            ),
            "kv": GaugeMetricFamily(
                "llmpool_worker_kv_cache_usage_ratio", "Share of KV blocks in use", labels=["worker", "model"]
            ),
            "tps": GaugeMetricFamily(
                "llmpool_worker_tokens_per_second", "Tokens generated per second, last 10 s", labels=["worker", "model"]
            ),
            "peak": GaugeMetricFamily(
                "llmpool_worker_peak_batch_size", "Largest batch the worker has run", labels=["worker", "model"]
            ),
            "draining": GaugeMetricFamily(
                "llmpool_worker_draining",
                "1 while the worker finishes its requests before leaving",
                labels=["worker", "model"],
            ),
        }
        counters = {
            "hits": CounterMetricFamily(
                "llmpool_worker_prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache",
                labels=["worker", "model"],
            ),
            "queried": CounterMetricFamily(
                "llmpool_worker_prefix_cache_queried_tokens",
                "Prompt tokens looked up in the prefix cache",
                labels=["worker", "model"],
            ),
            "preempt": CounterMetricFamily(
                "llmpool_worker_preemptions", "Requests preempted for lack of KV blocks", labels=["worker", "model"]
            ),
            "steps": CounterMetricFamily("llmpool_worker_steps", "Engine steps run", labels=["worker", "model"]),
            "proposed": CounterMetricFamily(
                "llmpool_worker_spec_proposed_tokens",
                "Speculative decoding: draft tokens proposed",
                labels=["worker", "model"],
            ),
            "accepted": CounterMetricFamily(
                "llmpool_worker_spec_accepted_tokens",
                "Speculative decoding: draft tokens accepted (acceptance rate: accepted / proposed)",
                labels=["worker", "model"],
            ),
        }
        counters |= kv_store_counters()
        gauges["kv_store_size"] = GaugeMetricFamily(
            "llmpool_worker_kv_store_size_bytes",
            "Bytes in the worker's KV store, as it last measured (a shared store: every worker's)",
            labels=["worker", "model"],
        )
        gauges["capacity"] = GaugeMetricFamily(
            "llmpool_worker_capacity_tokens_per_second",
            "Tokens per second of busy step time (what routing weighs outstanding work by)",
            labels=["worker", "model"],
        )
        for w in workers:
            name = [w["name"], w["model"]]
            gauges["running"].add_metric(name, w["running"])
            gauges["waiting"].add_metric(name, w["waiting"])
            gauges["kv"].add_metric(name, 1 - w["free_blocks"] / w["total_blocks"] if w["total_blocks"] else 0.0)
            gauges["tps"].add_metric(name, w["tokens_per_s"])
            gauges["peak"].add_metric(name, w["peak_batch_size"])
            gauges["draining"].add_metric(name, int(w["draining"]))
            counters["hits"].add_metric(name, w["prefix_hit_tokens"])
            counters["queried"].add_metric(name, w["prefix_queried_tokens"])
            counters["preempt"].add_metric(name, w["preemptions"])
            counters["steps"].add_metric(name, w["steps"])
            counters["proposed"].add_metric(name, w["spec_proposed_tokens"])
            counters["accepted"].add_metric(name, w["spec_accepted_tokens"])
            gauges["capacity"].add_metric(name, w["capacity_tokens_per_s"])
            if w["kv_store_id"]:
                gauges["kv_store_size"].add_metric(name, w["kv_store_size_bytes"])
                for field in KV_STORE_COUNTERS:
                    counters[field].add_metric(name, w[field])
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
        gone = {(d["name"], d["model"]) for d in snapshot["departed"]} - live  # recently dropped and not back
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
        yield from gauges.values()
        yield from counters.values()


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


def kv_store_counters() -> dict[str, CounterMetricFamily]:
    return {
        field: CounterMetricFamily(name, text, labels=["worker", "model"])
        for field, (name, text) in KV_STORE_COUNTERS.items()
    }


def http_metrics_middleware(metrics_of: Callable[[], Metrics | None]):  # an ASGI middleware factory
    """Count every HTTP response by path and status (streams count when their headers go out)."""

    def factory(app):
        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)

            async def counting_send(message):
                if message["type"] == "http.response.start":
                    metrics = metrics_of()
                    if metrics is not None:
                        metrics.http_requests.labels(metrics.path_label(scope["path"]), str(message["status"])).inc()
                await send(message)

            await app(scope, receive, counting_send)

        return middleware

    return factory
