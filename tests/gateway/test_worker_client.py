"""The gateway's ROUTER side against a scripted fake worker (a real DEALER socket on loopback)."""

import asyncio

import zmq
import zmq.asyncio

from common import protocol
from common.protocol import (
    Abort,
    AddRequests,
    DescribeModel,
    Goodbye,
    Heartbeat,
    ModelInfo,
    NewRequest,
    Ready,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    WorkerError,
)
from gateway.errors import GenerationFailed, NoWorkerAvailable
from gateway.worker_client import WorkerClient
from tests.conftest import free_port

READY = Ready("fake", "m", 1024, 4096, 16, 8, "cpu", "float32")


class FakeWorker:
    def __init__(self, address: str, name: bytes = b"fake") -> None:
        self.context = zmq.asyncio.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def send(self, msg) -> None:
        await self.sock.send_multipart(protocol.encode(msg))

    async def receive(self, kind: type, timeout: float = 5.0):
        """The next message of ``kind``, skipping heartbeats."""

        async def next_of_kind():
            while True:
                msg = protocol.decode(await self.sock.recv_multipart())
                if isinstance(msg, kind):
                    return msg

        return await asyncio.wait_for(next_of_kind(), timeout)

    def close(self) -> None:
        self.sock.close()
        self.context.term()


async def eventually(check, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def run(scenario) -> None:
    async def main():
        client = WorkerClient(f"tcp://127.0.0.1:{free_port()}", heartbeat_interval=0.2, heartbeat_liveness=3)
        await client.start()
        worker = FakeWorker(client.bind_address)
        try:
            await scenario(client, worker)
        finally:
            worker.close()
            await client.stop()

    asyncio.run(main())


def request(i: int) -> NewRequest:
    return NewRequest(f"r{i}", [1, 2, 3], 4)


def test_requests_of_one_tick_travel_together_and_outputs_reach_their_streams():
    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        streams = [client.submit(request(i), "m") for i in range(3)]
        added = await worker.receive(AddRequests)
        assert [r.request_id for r in added.requests] == ["r0", "r1", "r2"]
        assert client.add_messages_sent == 1
        await worker.send(StepOutputs([RequestOutput("r0", [5], None, 3, 1), RequestOutput("r1", [6], "stop", 3, 1)], batch_size=3))
        assert (await streams[0].queue.get()).new_token_ids == [5]
        final = await streams[1].queue.get()
        assert final.finish_reason == "stop" and streams[1].finished
        assert client.snapshot()["workers"][0]["peak_batch_size"] == 3
        client.abort("r0")
        assert (await worker.receive(Abort)).request_ids == ["r0"]
        assert client.snapshot()["workers"][0]["inflight"] == 1

    run(scenario)


def test_malformed_frames_are_dropped_and_the_socket_keeps_working():
    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        await worker.sock.send_multipart([b"\x01\x05", b"\xc1not msgpack"])
        await worker.sock.send_multipart([b"\x63\x02", b""])
        await worker.sock.send(b"one frame only")
        await eventually(lambda: client.dropped_frames == 3)
        stream = client.submit(request(0), "m")
        await worker.receive(AddRequests)
        await worker.send(StepOutputs([RequestOutput("r0", [7], "length", 3, 1)]))
        assert (await stream.queue.get()).new_token_ids == [7]

    run(scenario)


def test_goodbye_fails_in_flight_requests_with_a_clear_error():
    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        stream = client.submit(request(0), "m")
        await worker.receive(AddRequests)
        await worker.send(Goodbye("shutting down"))
        error = await asyncio.wait_for(stream.queue.get(), 5)
        assert isinstance(error, GenerationFailed) and "left" in error.message
        assert not client.workers

    run(scenario)


def test_a_silent_worker_expires_and_its_requests_fail():
    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        stream = client.submit(request(0), "m")
        error = await asyncio.wait_for(stream.queue.get(), 5)  # no heartbeats: gone after 3 x 0.2 s
        assert isinstance(error, GenerationFailed) and "missed 3 heartbeats" in error.message
        try:
            client.submit(request(1), "m")
        except NoWorkerAvailable:
            pass
        else:
            raise AssertionError("submit must fail with no worker")

    run(scenario)


def test_heartbeats_keep_a_worker_alive_and_carry_its_load():
    async def scenario(client, worker):
        await worker.send(READY)
        for _ in range(8):  # 1.6 s, well past the 0.6 s expiry
            await worker.send(Heartbeat(running=2, free_blocks=10, total_blocks=20))
            await worker.receive(Heartbeat)  # the gateway heartbeats back
        assert client.snapshot()["workers"][0]["running"] == 2

    run(scenario)


def test_requests_go_only_to_workers_of_their_model():
    async def scenario(client, worker):
        other = FakeWorker(client.bind_address, name=b"other")
        try:
            await other.send(Ready("other", "not-m", 1024, 4096, 16, 8, "cpu", "float32"))
            await eventually(lambda: client.workers)
            try:
                client.submit(request(0), "m")
            except NoWorkerAvailable as exc:
                assert "`m`" in exc.message
            else:
                raise AssertionError("a request for m must not go to a worker of not-m")
            await worker.send(READY)
            await eventually(lambda: len(client.workers) == 2)
            client.submit(request(1), "m")
            assert [r.request_id for r in (await worker.receive(AddRequests)).requests] == ["r1"]
            client.submit(request(2), "not-m")
            assert [r.request_id for r in (await other.receive(AddRequests)).requests] == ["r2"]
            assert client.limits("not-m") == (1024, 4096)
        finally:
            other.close()

    run(scenario)


def test_a_worker_with_another_tokenizer_under_a_served_name_is_refused():
    async def scenario(client, worker):
        await worker.send(Ready("fake", "m", 1024, 4096, 16, 8, "cpu", "float32", tokenizer_digest="aaa"))
        await eventually(lambda: client.workers)
        impostor = FakeWorker(client.bind_address, name=b"impostor")
        try:
            await impostor.send(Ready("impostor", "m", 1024, 4096, 16, 8, "cpu", "float32", tokenizer_digest="bbb"))
            await asyncio.sleep(0.3)
            assert [w.ready.worker_name for w in client.workers.values()] == ["fake"]
        finally:
            impostor.close()

    run(scenario)


def test_a_gateway_learns_a_model_from_its_first_worker_before_admitting_it():
    """learn_model set: the worker waits in joining, is asked for its tokenizer (DescribeModel), and
    is admitted once the gateway has loaded what it sent; a failed load asks again."""
    learned: list[str] = []

    async def learn(info: ModelInfo) -> None:
        if info.files == b"broken":
            raise ValueError("not a tokenizer")
        learned.append(info.model)

    async def main():
        client = WorkerClient(f"tcp://127.0.0.1:{free_port()}", heartbeat_interval=0.2, heartbeat_liveness=3, learn_model=learn)
        await client.start()
        worker = FakeWorker(client.bind_address)
        try:
            await worker.send(Ready("fake", "m", 1024, 4096, 16, 8, "cpu", "float32", tokenizer_digest="d1"))
            ask = await worker.receive(DescribeModel)
            assert ask.tokenizer_digest == "d1" and not client.workers and client.snapshot()["joining"] == [{"name": "fake", "model": "m"}]
            await worker.send(ModelInfo("m", "d1", b"broken"))
            await asyncio.sleep(0.3)
            assert not client.workers and not learned
            await worker.send(Ready("fake", "m", 1024, 4096, 16, 8, "cpu", "float32", tokenizer_digest="d1"))
            await worker.receive(DescribeModel)
            await worker.send(ModelInfo("m", "d1", b"files"))
            await eventually(lambda: client.workers)
            assert learned == ["m"] and client.models["m"].digest == "d1"
        finally:
            worker.close()
            await client.stop()

    asyncio.run(main())


def test_a_worker_twice_as_fast_gets_about_twice_the_work():
    """Outstanding work is weighed by each worker's measured speed (capacity from its heartbeats)."""

    async def scenario(client, worker):
        slow = FakeWorker(client.bind_address, name=b"slow")
        try:
            await worker.send(READY)
            await slow.send(Ready("slow", "m", 1024, 4096, 16, 8, "cpu", "float32"))
            await eventually(lambda: len(client.workers) == 2)
            await worker.send(Heartbeat(capacity_tokens_per_s=200.0))
            await slow.send(Heartbeat(capacity_tokens_per_s=100.0))
            await eventually(lambda: all(w.heartbeats for w in client.workers.values()))
            for i in range(30):
                client.submit(request(i), "m")
            shares = {w.ready.worker_name: len(w.inflight) for w in client.workers.values()}
            assert sum(shares.values()) == 30 and 1.6 <= shares["fake"] / shares["slow"] <= 2.2, shares
            # Like workers whose figures differ by noise share the work instead of the faster taking all.
            await slow.send(Heartbeat(capacity_tokens_per_s=185.0))
            await eventually(lambda: client.workers[b"slow"].load.capacity_tokens_per_s == 185.0)
            for w in client.workers.values():
                for request_id in list(w.inflight):
                    client.abort(request_id)
            for i in range(30, 40):
                client.submit(request(i), "m")
            shares = {w.ready.worker_name: len(w.inflight) for w in client.workers.values()}
            assert shares == {"fake": 5, "slow": 5}
        finally:
            slow.close()

    run(scenario)


def test_a_worker_registering_again_replaces_its_old_entry_and_takes_its_requests_back():
    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        stream = client.submit(request(0), "m")
        await worker.receive(AddRequests)
        worker.sock.close()  # the old process is gone, and its connection with it
        restarted = FakeWorker(client.bind_address, name=b"fake-restarted")
        try:
            answer = None
            while not isinstance(answer, AddRequests):  # same worker_name, new identity: the same worker, restarted
                await restarted.send(READY)  # refused while the ROUTER still routes to the old connection: retry
                answer = await restarted.receive((AddRequests, WorkerError))
            resent = answer
            assert [r.request_id for r in resent.requests] == ["r0.1"]  # each attempt has its own wire id
            assert [w.identity for w in client.workers.values()] == [b"fake-restarted"]
            await restarted.send(StepOutputs([RequestOutput("r0.1", [9], "length", 3, 1)]))
            assert (await asyncio.wait_for(stream.queue.get(), 5)).new_token_ids == [9]
        finally:
            restarted.close()

    run(scenario)


def test_a_second_live_worker_with_the_same_name_is_refused_and_told_why():
    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        twin = FakeWorker(client.bind_address, name=b"twin")
        try:
            await twin.send(READY)  # same worker_name, and the first one's connection is open
            refusal = await twin.receive(WorkerError)
            assert "another live worker is registered as 'fake'" in refusal.message
            assert list(client.workers) == [b"fake"] and not client.departed
        finally:
            twin.close()

    run(scenario)


def test_a_dead_workers_requests_resume_on_another_worker_where_they_left_off():
    async def scenario(client, worker):
        other = FakeWorker(client.bind_address, name=b"other")
        try:
            await worker.send(READY)
            await eventually(lambda: client.workers)
            stream = client.submit(NewRequest("r0", [1, 2, 3], 5, SamplingParams(temperature=0.7, seed=11)), "m")
            await worker.receive(AddRequests)
            await other.send(Ready("other", "m", 1024, 4096, 16, 8, "cpu", "float32"))
            await eventually(lambda: len(client.workers) == 2)
            await worker.send(StepOutputs([RequestOutput("r0", [7], None, 3, 1)]))
            await worker.send(StepOutputs([RequestOutput("r0", [8], None, 3, 2, seq=1)]))
            await worker.send(Goodbye("crashing"))
            moved = (await other.receive(AddRequests)).requests[0]
            assert moved.prompt_token_ids == [1, 2, 3, 7, 8] and moved.max_new_tokens == 3
            assert moved.sampling.temperature == 0.7 and moved.sampling.seed == 13
            await other.send(StepOutputs([RequestOutput("r0.1", [9], "length", 5, 1)]))
            outputs = [await asyncio.wait_for(stream.queue.get(), 5) for _ in range(3)]
            assert [o.new_token_ids for o in outputs] == [[7], [8], [9]]
            assert (outputs[-1].num_prompt_tokens, outputs[-1].num_output_tokens) == (3, 3)
            assert client.resumed == 1
        finally:
            other.close()

    run(scenario)


def test_a_worker_that_heartbeats_but_makes_no_progress_counts_as_hung():
    async def main():
        client = WorkerClient(f"tcp://127.0.0.1:{free_port()}", heartbeat_interval=0.1, heartbeat_liveness=5, hung_timeout=0.6)
        await client.start()
        worker = FakeWorker(client.bind_address)
        try:
            await worker.send(READY)
            await eventually(lambda: client.workers)
            stream = client.submit(request(0), "m")
            await worker.receive(AddRequests)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 5
            while stream.queue.empty() and loop.time() < deadline:  # heartbeats keep coming, tokens don't
                await worker.send(Heartbeat(running=1))
                await asyncio.sleep(0.05)
            error = stream.queue.get_nowait()
            assert isinstance(error, GenerationFailed) and "made no progress" in error.message
            assert not client.workers
        finally:
            worker.close()
            await client.stop()

    asyncio.run(main())


def test_a_request_the_worker_never_accepted_fails_alone_and_the_worker_is_not_hung():
    """The worker heartbeats that it holds nothing while the gateway counts a request on it (a
    message lost or unreadable): after ``liveness`` heartbeats the request is sent again (the
    resume path, max_retries times) and then ends with an error; the worker stays registered and
    ready, though hung_timeout passed many times meanwhile."""

    async def main():
        client = WorkerClient(f"tcp://127.0.0.1:{free_port()}", heartbeat_interval=0.1, heartbeat_liveness=5, hung_timeout=0.3)
        await client.start()
        worker = FakeWorker(client.bind_address)
        try:
            await worker.send(READY)
            await eventually(lambda: client.workers)
            stream = client.submit(request(0), "m")
            await worker.receive(AddRequests)  # and loses it, and the two resends
            loop = asyncio.get_running_loop()
            started, ready_throughout = loop.time(), True
            while stream.queue.empty() and loop.time() < started + 5:
                await worker.send(Heartbeat())  # running 0, waiting 0
                await asyncio.sleep(0.1)
                ready_throughout &= bool(client.ready_workers())
            error = stream.queue.get_nowait()
            assert isinstance(error, GenerationFailed) and "does not hold the request" in error.message
            assert "moved 2 times" in error.message and client.resumed == 2
            assert loop.time() - started > 0.5 and ready_throughout
            assert client.workers and client.snapshot()["workers"][0]["inflight"] == 0
            for _ in range(5):  # past hung_timeout again: still there
                await worker.send(Heartbeat())
                await asyncio.sleep(0.1)
            assert client.workers and not client.departed
        finally:
            worker.close()
            await client.stop()

    asyncio.run(main())


def test_prefix_affinity_sends_a_shared_prefix_to_the_same_worker_unless_it_is_much_busier():
    from gateway.pool import PrefixAffinity, WorkerInfo

    a = WorkerInfo(b"a", READY, 0.0)
    b = WorkerInfo(b"b", READY, 0.0)
    affinity = PrefixAffinity(slack_tokens=1000)
    workers = {w.identity: w for w in (a, b)}
    system = list(range(600))
    assert affinity.choose("m", system + [1], workers.get, best=a) is a
    a.outstanding_tokens = 900  # busier, but within the slack: still a, where the prefix is cached
    assert affinity.choose("m", system + [2], workers.get, best=b) is a
    assert affinity.choose("other-model", system + [2], workers.get, best=b) is b  # prefixes are per model
    a.outstanding_tokens = 5000  # much busier: the least-loaded one takes it (and the prefix moves)
    assert affinity.choose("m", system + [3], workers.get, best=b) is b
    assert affinity.choose("m", list(range(1000, 1100)), workers.get, best=a) is a  # an unseen prefix
    assert affinity.choose("m", [1, 2, 3], workers.get, best=b) is b  # too short to bother
    a.outstanding_tokens = 0
    del workers[b"b"]  # the owner of the prefix left: the best one takes it
    assert affinity.choose("m", system + [4], workers.get, best=a) is a
    assert affinity.hits == 1


def test_prefix_affinity_lets_workers_sharing_a_kv_store_take_each_others_prefixes():
    """Workers whose heartbeats name the same KV store read a prefix any of them computed: the
    prefix stays on its worker only while that worker is no busier than the least loaded one."""
    from common.protocol import Heartbeat
    from gateway.pool import PrefixAffinity, WorkerInfo

    a, b, c = (WorkerInfo(name, READY, 0.0, load=Heartbeat(kv_store_id="s1-fp")) for name in (b"a", b"b", b"c"))
    c.load = Heartbeat(kv_store_id="s2-fp")  # another store (or another model fingerprint)
    workers = {w.identity: w for w in (a, b, c)}
    affinity = PrefixAffinity(slack_tokens=1000)
    system = list(range(600))
    assert affinity.choose("m", system + [1], workers.get, best=a) is a
    assert affinity.choose("m", system + [2], workers.get, best=b) is a  # a tie: a's RAM beats b's store read
    a.outstanding_tokens = 300  # busier, though well within the slack: b loads the prefix from the store
    assert affinity.choose("m", system + [3], workers.get, best=b) is b
    assert affinity.store_routed == 1
    b.outstanding_tokens = 600  # b holds it now; c does not share the store: the slack applies as before
    assert affinity.choose("m", system + [4], workers.get, best=c) is b
    assert affinity.store_routed == 1 and affinity.hits == 2


def test_a_lost_output_is_noticed_and_the_request_resumes_from_what_was_delivered():
    """The worker skips the output carrying token 8 (seq 1): the gateway sees seq 2 arrive where
    1 was due, stops the old attempt, and sends the request again as prompt + the tokens delivered
    (under a new wire id, so the old attempt's late outputs can't mix in). The client reads 7 8 9
    with no hole, and usage counts what it got."""

    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        stream = client.submit(NewRequest("r0", [1, 2, 3], 3, SamplingParams(temperature=0)), "m")
        await worker.receive(AddRequests)
        await worker.send(StepOutputs([RequestOutput("r0", [7], None, 3, 1, seq=0)]))
        await worker.send(StepOutputs([RequestOutput("r0", [9], None, 3, 3, seq=2)]))  # seq 1 ([8]) lost
        assert (await worker.receive(Abort)).request_ids == ["r0"]
        again = (await worker.receive(AddRequests)).requests[0]
        assert (again.request_id, again.prompt_token_ids, again.max_new_tokens) == ("r0.1", [1, 2, 3, 7], 2)
        await worker.send(StepOutputs([RequestOutput("r0", [], "abort", 3, 3, seq=3)]))  # the old attempt's: ignored
        await worker.send(StepOutputs([RequestOutput("r0.1", [8], None, 4, 1, seq=0)]))
        await worker.send(StepOutputs([RequestOutput("r0.1", [9], "length", 4, 2, seq=1)]))
        outputs = [await asyncio.wait_for(stream.queue.get(), 5) for _ in range(3)]
        assert [o.new_token_ids for o in outputs] == [[7], [8], [9]]
        assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 3
        assert stream.finished and client.resumed == 1 and client.workers

    run(scenario)
