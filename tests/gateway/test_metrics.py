"""/metrics' pool figures against fake workers on real sockets."""

import threading
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

from common.protocol import Goodbye, Heartbeat, Ready
from gateway.fleet.dispatch import Dispatcher
from gateway.ops.metrics import Metrics
from gateway.policy.admission import Admission
from tests.conftest import wait_until
from tests.gateway.test_worker_client import READY, FakeWorker, eventually, run


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_dead_workers_are_counted_as_they_are_now_and_departures_as_a_counter():
    """Two departures of a worker that came back each time, and one of a worker that stayed away:
    one worker is dead, three departures happened."""

    async def scenario(client, worker):
        metrics = Metrics(client.snapshot, Admission(4, 4))
        other = FakeWorker(client.bind_address, name=b"other")
        try:
            await other.send(Ready("other", "m", 1024, 4096, 16, 8, "cpu", "float32"))
            for _ in range(2):  # "fake" leaves and registers again (a restart)
                await worker.send(READY)
                await eventually(lambda: len(client.workers) == 2)
                await worker.send(Goodbye("restarting"))
                await eventually(lambda: len(client.workers) == 1)
            await worker.send(READY)
            await eventually(lambda: len(client.workers) == 2)
            await other.send(Goodbye("for good"))
            await eventually(lambda: len(client.workers) == 1)
            seen = samples(metrics)
            assert seen[("llmpool_workers", (("state", "dead"),))] == 1
            assert seen[("llmpool_worker_departures_total", ())] == 3
            assert seen[("llmpool_worker_up", (("model", "m"), ("worker", "fake")))] == 1
            assert seen[("llmpool_worker_up", (("model", "m"), ("worker", "other")))] == 0
        finally:
            other.close()

    run(scenario)


def test_kv_store_figures_come_from_the_heartbeats():
    async def scenario(client, worker):
        metrics = Metrics(client.snapshot, Admission(4, 4))
        await worker.send(READY)
        await eventually(lambda: len(client.workers) == 1)
        assert not [
            name for name, _ in samples(metrics) if name.startswith("llmpool_worker_kv_store")
        ]  # no store: no series
        await worker.send(
            Heartbeat(
                kv_store_id="s-fp",
                kv_store_hits=7,
                kv_store_misses=2,
                kv_store_read_bytes=4096,
                kv_store_size_bytes=10**6,
            )
        )
        await eventually(lambda: client.snapshot()["workers"][0]["kv_store_hits"] == 7)
        (shown,) = client.snapshot()["workers"]
        assert (shown["kv_store_id"], shown["kv_store_misses"], shown["kv_store_read_bytes"]) == ("s-fp", 2, 4096)
        seen = samples(metrics)
        labels = (("model", "m"), ("worker", "fake"))
        assert seen[("llmpool_worker_kv_store_hit_blocks_total", labels)] == 7
        assert seen[("llmpool_worker_kv_store_miss_blocks_total", labels)] == 2
        assert seen[("llmpool_worker_kv_store_size_bytes", labels)] == 10**6
        assert seen[("llmpool_kv_store_routed_requests_total", ())] == 0

    run(scenario)


def test_tokenize_jobs_are_counted_while_queued_and_by_how_they_ended():
    """One thread in the lane: a job that runs, one queued behind it, one that fails, one cancelled
    before it ran, and a template render its budget stopped."""
    metrics = Metrics(Dispatcher(1.0, 3).snapshot, Admission(4, 4))
    release = threading.Event()
    lane = ThreadPoolExecutor(max_workers=1)
    try:
        running = lane.submit(release.wait, 10)
        metrics.track_job("big", running, lambda: None)
        failing = lane.submit(lambda: 1 / 0)
        metrics.track_job("big", failing, lambda: None)
        never = lane.submit(int)
        metrics.track_job("big", never, lambda: None)
        stopped = lane.submit(int)
        metrics.track_job("big", stopped, lambda: "deadline")
        assert samples(metrics)[("llmpool_gateway_tokenize_jobs", (("lane", "big"),))] == 4
        assert never.cancel()
        release.set()

        def ended() -> dict[str, float]:
            seen = samples(metrics).items()
            return {
                dict(labels)["outcome"]: v
                for (name, labels), v in seen
                if name == "llmpool_gateway_tokenize_jobs_ended_total"
            }

        wait_until(
            lambda: sum(ended().values()) == 4, 10, "the jobs to end"
        )  # a future's callbacks run just after its result is set
        assert ended() == {"done": 1, "error": 1, "cancelled": 1, "deadline": 1}
        assert samples(metrics)[("llmpool_gateway_tokenize_jobs", (("lane", "big"),))] == 0
    finally:
        lane.shutdown()
