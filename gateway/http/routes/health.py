"""Operator endpoints: /health (process up), /ready (a worker can take requests), /workers (the pool
as JSON), /metrics (Prometheus)."""

from __future__ import annotations

from litestar import Response, get
from litestar.di import NamedDependency
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.batch.runner import BatchRunner
from gateway.generate.model_registry import ModelRegistry
from gateway.http.routes.common import json_response


@get("/health")
async def health(models: NamedDependency[ModelRegistry]) -> Response:
    """200 while the gateway runs (the liveness probe: restarting it would not mend a worker);
    ``degraded`` with each worker's error while workers fail to start (in the last 5 minutes)."""
    registered = {worker.ready.worker_name for worker in models.client.workers.values()}
    failing = models.client.dispatch.roster.start_failures.recent(registered)
    return json_response({"status": "degraded", "failing": failing} if failing else {"status": "ok"})


@get("/ready")
async def ready(models: NamedDependency[ModelRegistry]) -> Response:
    """200 when at least one worker takes requests and makes progress on those it holds, and
    admission makes progress: 503 while requests wait and no slot was granted or released for
    --hung-timeout seconds."""
    workers = len([w for w in models.client.ready_workers() if w.ready.model in models.served_models])
    stalled = models.admission.stalled()
    status = "admission stalled" if stalled else "ready" if workers else "no worker ready"
    response = json_response({"status": status, "workers": workers, "waiting": models.admission.waiting})
    response.status_code = 200 if workers and not stalled else 503
    return response


@get("/workers")
async def workers(
    models: NamedDependency[ModelRegistry], batch_runner: NamedDependency[BatchRunner | None]
) -> Response:
    runner = batch_runner  # this gateway's share of the batch work
    return json_response({**models.client.snapshot(), "batch_runner": runner.snapshot() if runner else None})


@get("/metrics")
async def metrics(models: NamedDependency[ModelRegistry]) -> Response:
    return Response(content=models.metrics.render(), media_type=CONTENT_TYPE_LATEST)
