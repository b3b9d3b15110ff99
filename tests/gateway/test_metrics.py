"""/metrics' pool figures against fake workers on real sockets."""

from prometheus_client.parser import text_string_to_metric_families

from common.protocol import Goodbye, Heartbeat, Ready
from gateway.admission import Admission
from gateway.metrics import Metrics
from tests.gateway.test_worker_client import READY, FakeWorker, eventually, run


def samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


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
        assert not [name for name, _ in samples(metrics) if name.startswith("llmpool_worker_kv_store")]  # no store: no series
        await worker.send(Heartbeat(kv_store_id="s-fp", kv_store_hits=7, kv_store_misses=2, kv_store_read_bytes=4096, kv_store_size_bytes=10**6))
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
