"""GET /metrics in Prometheus format: request outcomes, latency histograms, and the pool's state.

Latencies are recorded by the generation pipeline as tokens pass through; per-worker figures
(batch, queue, KV usage, prefix-cache hits) are read from the workers' latest heartbeats at scrape
time. prometheus_client does the exposition format and histogram buckets.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from common.protocol import RequestOutput
from gateway.ops.pool_metrics import PoolCollector
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
        self.unknown_fields = Counter(
            "llmpool_unknown_fields",
            "Request fields no API defines, by name (gateway/http/fields.py)",
            ["field"],
            registry=r,
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
        self._itl: Any = None

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
            if self._itl is None:  # the model's child, looked up once (a lookup per token cost 10 us)
                self._itl = self.metrics.itl.labels(self.model)
            for _ in range(count):
                self._itl.observe(gap)
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
