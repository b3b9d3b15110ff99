"""The gateway's ROUTER side against a scripted fake worker (a real DEALER socket on loopback): what
needs the socket (one AddRequests per loop tick, malformed frames, heartbeats both ways, a worker's
reachability, tokenizer loading, another protocol version). What dispatch decides is tested without
sockets in test_dispatch.py."""

import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

from common import protocol
from common.protocol import (
    Abort,
    AddRequests,
    DescribeModel,
    Heartbeat,
    ModelInfo,
    NewRequest,
    Ready,
    RequestOutput,
    StepOutputs,
    WorkerError,
)
from gateway.errors import GenerationFailed, NoWorkerAvailable
from gateway.fleet.worker_client import WorkerClient
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


def run(scenario, heartbeat_interval: float = 0.2) -> None:
    async def main():
        client = WorkerClient(f"tcp://127.0.0.1:{free_port()}", heartbeat_interval, heartbeat_liveness=3)
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
        assert client.snapshot()["add_messages_sent"] == 1
        await worker.send(
            StepOutputs([RequestOutput("r0", [5], None, 3, 1), RequestOutput("r1", [6], "stop", 3, 1)], batch_size=3)
        )
        assert (await streams[0].queue.get()).new_token_ids == [5]
        final = await streams[1].queue.get()
        assert final.finish_reason == "stop" and streams[1].finished
        assert client.snapshot()["workers"][0]["peak_batch_size"] == 3
        client.abort("r0")
        assert (await worker.receive(Abort)).request_ids == ["r0"]
        assert client.snapshot()["workers"][0]["inflight"] == 1

    run(scenario)


def test_an_output_that_lands_just_before_a_send_is_read_at_once():
    """zmq's FD signals a change once, and a send takes the signals pending: an output that landed
    just before the gateway sent something must still be read then, not when the next message
    (here a heartbeat 30 s away) signals again."""

    async def scenario(client, worker):
        await worker.send(READY)
        await eventually(lambda: client.workers)
        stream = client.submit(request(0), "m")
        await worker.receive(AddRequests)
        for token in range(5):
            await worker.send(StepOutputs([RequestOutput("r0", [token], None, 3, token + 1, seq=token)]))
            time.sleep(0.05)  # the event loop held: the output reaches the ROUTER and signals its FD
            client.send(b"fake", Heartbeat())  # a send on the ROUTER takes that signal
            output = await asyncio.wait_for(stream.queue.get(), 2.0)
            assert output.new_token_ids == [token]

    run(scenario, heartbeat_interval=30.0)


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


def test_a_gateway_learns_a_model_from_its_first_worker_before_admitting_it():
    """learn_model set: the worker waits in joining, is asked for its tokenizer (DescribeModel), and
    is admitted once the gateway has loaded what it sent; a failed load asks again."""
    learned: list[str] = []

    async def learn(info: ModelInfo) -> None:
        if info.files == b"broken":
            raise ValueError("not a tokenizer")
        learned.append(info.model)

    async def main():
        client = WorkerClient(
            f"tcp://127.0.0.1:{free_port()}", heartbeat_interval=0.2, heartbeat_liveness=3, learn_model=learn
        )
        await client.start()
        worker = FakeWorker(client.bind_address)
        try:
            await worker.send(Ready("fake", "m", 1024, 4096, 16, 8, "cpu", "float32", tokenizer_digest="d1"))
            ask = await worker.receive(DescribeModel)
            assert (
                ask.tokenizer_digest == "d1"
                and not client.workers
                and client.snapshot()["joining"] == [{"name": "fake", "model": "m"}]
            )
            await worker.send(ModelInfo("m", "d1", b"broken"))
            await eventually(lambda: not client.dispatch.roster.joining)  # the load failed: the joiner is dropped
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
            assert list(client.workers) == [b"fake"] and not client.snapshot()["departed"]
        finally:
            twin.close()

    run(scenario)


def test_a_worker_of_the_old_protocol_is_refused_in_words_it_reads(caplog):
    """A version-1 worker sends its Ready as a map under a version-1 header: the gateway logs that it
    refuses it and why, and answers with the version-1 WorkerError map that such a worker decodes
    and logs (worker/proc.py of that version logs "the gateway at ...: <message>")."""

    async def scenario(client, worker):
        old_ready = {
            "worker_name": "old",
            "model": "m",
            "max_model_len": 1024,
            "kv_capacity_tokens": 4096,
            "protocol_version": 1,
        }
        await worker.sock.send_multipart([bytes((1, protocol.MsgType.READY)), msgspec.msgpack.encode(old_ready)])
        header, payload = await asyncio.wait_for(worker.sock.recv_multipart(), 5)
        assert header == bytes((1, protocol.MsgType.ERROR))
        answer = msgspec.msgpack.decode(payload)
        assert (
            answer["request_id"] is None
            and f"it speaks protocol 1; this gateway speaks {protocol.PROTOCOL_VERSION}" in answer["message"]
        )
        assert not client.workers and client.snapshot()["dropped_frames"] == 1
        assert any("refused worker old: it speaks protocol 1" in r.getMessage() for r in caplog.records)

    run(scenario)
