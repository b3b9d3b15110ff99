"""The worker's socket loop against a scripted fake gateway (a real ROUTER on loopback) and a stub engine."""

import threading
import time
from types import SimpleNamespace

import msgspec
import zmq

from common import protocol
from common.protocol import Abort, AddRequests, Goodbye, Heartbeat, NewRequest, Ready, RequestOutput, StepOutputs
from tests.conftest import free_port, wait_until
from worker.handshake import GatewayLink, resolve_gateways
from worker.proc import WorkerProc


class StubEngine:
    """Answers each request with one token, then finishes it."""

    max_model_len = 128
    max_num_seqs = 4
    blocks = SimpleNamespace(capacity_tokens=64, block_size=16)

    def __init__(self) -> None:
        self.pending: list[NewRequest] = []
        self.rejected: list[RequestOutput] = []
        self.failed_all = 0

    def add_request(self, new: NewRequest) -> None:
        self.pending.append(new)

    def reject(self, request_id: str, error: str, num_prompt_tokens: int = 0, bad_request: bool = False) -> None:
        self.rejected.append(
            RequestOutput(request_id, [], "error", num_prompt_tokens, error=error, bad_request=bad_request)
        )

    def abort(self, ids: list[str]) -> list[RequestOutput]:
        self.pending = [r for r in self.pending if r.request_id not in ids]
        return [RequestOutput(i, [], "abort") for i in ids]

    def has_work(self) -> bool:
        return bool(self.pending or self.rejected)

    def step(self) -> StepOutputs:
        (done, self.pending), (rejected, self.rejected) = (self.pending, []), (self.rejected, [])
        outputs = [RequestOutput(r.request_id, [42], "length", len(r.prompt_token_ids), 1) for r in done]
        return StepOutputs(rejected + outputs, batch_size=len(done))

    def fail_all(self, message: str) -> list[RequestOutput]:
        self.failed_all += 1
        return []

    def load(self) -> Heartbeat:
        return Heartbeat(running=len(self.pending))


class FakeGateway:
    def __init__(self) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.sock.bind(self.address)

    def receive(self, kind: type, timeout: float = 5.0) -> tuple[bytes, object]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                identity, *frames = self.sock.recv_multipart()
                msg = protocol.decode(frames)
                if isinstance(msg, kind):
                    return identity, msg
        raise TimeoutError(f"no {kind.__name__} from the worker")

    def send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, *protocol.encode(msg)])

    def close(self) -> None:
        self.sock.close()
        self.context.term()


def start_worker(address: str, engine: StubEngine) -> tuple[WorkerProc, threading.Thread]:
    proc = WorkerProc(engine, address, "w-test", "m", "cpu", "float32", heartbeat_interval=0.1, heartbeat_liveness=3)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    return proc, thread


def test_worker_registers_serves_survives_garbage_and_says_goodbye():
    gateway = FakeGateway()
    engine = StubEngine()
    proc, thread = start_worker(gateway.address, engine)
    try:
        identity, ready = gateway.receive(Ready)
        assert (ready.worker_name, ready.model, ready.kv_capacity_tokens, ready.max_batch_size) == (
            "w-test",
            "m",
            64,
            4,
        )
        gateway.sock.send_multipart([identity, b"\x01\x03", b"\xc1 not msgpack"])
        gateway.sock.send_multipart([identity, b"junk"])
        gateway.send(identity, AddRequests([NewRequest("a", [1, 2], 5), NewRequest("b", [3], 5)]))
        _, step = gateway.receive(StepOutputs)
        assert step.batch_size == 2 and [(o.request_id, o.new_token_ids) for o in step.outputs] == [
            ("a", [42]),
            ("b", [42]),
        ]
        gateway.send(identity, Abort(["zzz"]))
        _, aborted = gateway.receive(StepOutputs)
        assert aborted.outputs[0].finish_reason == "abort"
        proc.stopping = True
        gateway.receive(Goodbye)
        thread.join(5)
        assert not thread.is_alive()
    finally:
        proc.stopping = True
        gateway.close()


def test_worker_reconnects_and_registers_again_when_the_gateway_goes_silent():
    gateway = FakeGateway()
    engine = StubEngine()
    engine.step = lambda: StepOutputs([])  # holds its requests: nothing finishes
    proc, thread = start_worker(gateway.address, engine)
    try:
        first, _ = gateway.receive(Ready)
        gateway.send(first, AddRequests([NewRequest("held", [1], 5)]))
        # Then never answer: after 3 x 0.1 s of silence the worker drops that gateway's requests and reconnects.
        second, again = gateway.receive(Ready, timeout=5)
        assert second != first and again.worker_name == "w-test"
        assert engine.pending == [] and "held" not in proc.owner
    finally:
        proc.stopping = True
        thread.join(5)
        gateway.close()


def test_a_worker_serves_every_gateway_and_answers_each_its_own_requests():
    """Two gateways: each gets the Ready, each request's output goes back where it came from, and a
    gateway that goes silent costs only its own requests while the other keeps being served."""
    gateways = [FakeGateway(), FakeGateway()]
    engine = StubEngine()
    proc = WorkerProc(
        engine,
        ",".join(g.address for g in gateways),
        "w-test",
        "m",
        "cpu",
        "float32",
        heartbeat_interval=0.1,
        heartbeat_liveness=3,
    )
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    try:
        (a, _), (b, _) = gateways[0].receive(Ready), gateways[1].receive(Ready)
        gateways[0].send(a, AddRequests([NewRequest("from-a", [1], 5)]))
        gateways[1].send(b, AddRequests([NewRequest("from-b", [1], 5)]))
        _, step_a = gateways[0].receive(StepOutputs)
        _, step_b = gateways[1].receive(StepOutputs)
        assert [o.request_id for o in step_a.outputs] == ["from-a"] and [o.request_id for o in step_b.outputs] == [
            "from-b"
        ]
        _, load = gateways[1].receive(Heartbeat)
        assert load.capacity_tokens_per_s > 0  # it measured its speed on the steps it ran
        # Gateway b stops talking; a keeps heartbeating until the worker has judged b silent (it
        # registers with b again), and is served throughout: a's connection is the same one.
        deadline = time.monotonic() + 10
        while True:
            gateways[0].send(a, Heartbeat())
            if gateways[1].sock.poll(50) and isinstance(protocol.decode(gateways[1].sock.recv_multipart()[1:]), Ready):
                break
            assert time.monotonic() < deadline, "gateway b was never judged silent"
        gateways[0].send(a, AddRequests([NewRequest("again-a", [1], 5)]))
        _, step = gateways[0].receive(StepOutputs)
        assert [o.request_id for o in step.outputs] == ["again-a"]
    finally:
        proc.stopping = True
        thread.join(5)
        for g in gateways:
            g.close()


def test_a_name_that_resolves_to_several_addresses_is_several_gateways():
    assert resolve_gateways("tcp://localhost:5555, ipc:///tmp/x,tcp://10.0.0.1:7") == [
        "tcp://127.0.0.1:5555",
        "ipc:///tmp/x",
        "tcp://10.0.0.1:7",
    ]
    assert resolve_gateways("tcp://no-such-host.invalid:5555") == ["tcp://no-such-host.invalid:5555"]  # zmq retries it


def test_a_request_the_worker_cannot_decode_is_answered_with_an_error_not_dropped():
    """An AddRequests holding a prompt of booleans: its good request runs, the bad one gets an error
    of its own (the gateway waited 180 s on it before)."""
    gateway = FakeGateway()
    engine = StubEngine()
    proc, thread = start_worker(gateway.address, engine)
    try:
        identity, _ = gateway.receive(Ready)
        frames = protocol.encode(AddRequests([NewRequest("good", [1, 2], 5), NewRequest("bad", [1], 5)]))
        payload = msgspec.msgpack.decode(frames[1])
        payload[0][1][1] = [True, False]  # the second request's prompt_token_ids
        gateway.sock.send_multipart([identity, frames[0], msgspec.msgpack.encode(payload)])
        _, step = gateway.receive(StepOutputs)
        outputs = {o.request_id: o for o in step.outputs}
        assert outputs["good"].new_token_ids == [42]
        assert outputs["bad"].finish_reason == "error" and outputs["bad"].bad_request and "bool" in outputs["bad"].error
    finally:
        proc.stopping = True
        thread.join(5)
        gateway.close()


def test_messages_the_socket_cannot_take_wait_in_order_instead_of_being_dropped():
    """A gateway that does not read fills the DEALER's queue (zmq.Again): the outputs wait and go,
    in order, once it reads again; before, each was dropped and its stream had a silent hole."""

    class FullSocket:
        def __init__(self) -> None:
            self.accepting = False
            self.sent: list[list[bytes]] = []

        def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
            if not self.accepting:
                raise zmq.Again()
            self.sent.append(frames)

    link = GatewayLink("tcp://127.0.0.1:1")
    link.sock = FullSocket()
    steps = [StepOutputs([RequestOutput("a", [i], seq=i)]) for i in range(3)]
    for step in steps[:2]:
        link.send(step)
    link.sock.accepting = True
    link.send(steps[2])  # behind the held ones, never ahead of them
    assert not link.sock.sent
    link.flush()
    assert [protocol.decode(frames) for frames in link.sock.sent] == steps


def test_socket_work_overlaps_the_step_in_flight():
    """Async scheduling: step N's outputs go out while step N+1 runs, and a message that arrives
    during a step is answered before the step ends (the socket loop does not wait for the model)."""

    class SlowEngine(StubEngine):
        step_s = 0.8

        def __init__(self) -> None:
            super().__init__()
            self.started = self.finished = 0

        def has_work(self) -> bool:
            return bool(self.pending)

        def step(self) -> StepOutputs:
            self.started += 1
            time.sleep(self.step_s)
            self.finished += 1
            return StepOutputs(
                [RequestOutput(r.request_id, [self.finished], seq=self.finished) for r in self.pending],
                batch_size=len(self.pending),
            )

    gateway = FakeGateway()
    engine = SlowEngine()
    proc = WorkerProc(
        engine, gateway.address, "w-test", "m", "cpu", "float32", heartbeat_interval=0.1, heartbeat_liveness=50
    )
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    try:
        identity, _ = gateway.receive(Ready)
        gateway.send(identity, AddRequests([NewRequest("long", [1], 100)]))
        _, first = gateway.receive(StepOutputs)
        assert first.outputs[0].new_token_ids == [1]
        wait_until(lambda: engine.started == 2, 10, "step 2", interval=0.01)  # the engine went on to step 2 on its own
        gateway.send(identity, protocol.DescribeModel())
        gateway.receive(protocol.WorkerError)  # no tokenizer bundle here: answered with an error, mid-step
        assert engine.finished == 1
    finally:
        proc.stopping = True
        thread.join(5)
        gateway.close()


def test_heartbeats_go_on_through_a_step_longer_than_the_liveness():
    """A step may outlast the liveness (a long prefill chunk on a CPU, a first-use import): the worker
    says it is alive meanwhile, with the requests it holds (those that arrived during the step among
    them), so the gateway neither takes it for dead nor resumes its requests elsewhere."""

    class OneLongStep(StubEngine):
        def __init__(self) -> None:
            super().__init__()
            self.steps = 0

        def step(self) -> StepOutputs:
            self.steps += 1
            time.sleep(1.5 if self.steps == 1 else 0.01)
            return StepOutputs([])  # holds its requests

    gateway = FakeGateway()
    engine = OneLongStep()
    proc, thread = start_worker(gateway.address, engine)  # heartbeats every 0.1 s, dead after 0.3 s
    try:
        identity, _ = gateway.receive(Ready)
        gateway.send(identity, AddRequests([NewRequest("long", [1], 5)]))
        wait_until(lambda: engine.steps == 1, 2, "the long step")
        gateway.send(identity, AddRequests([NewRequest("late", [2], 5)]))
        seen: list[tuple[float, int, int]] = []  # (when, running, waiting) of each heartbeat during the step
        start = time.monotonic()
        while engine.steps == 1 and time.monotonic() - start < 3:
            gateway.send(identity, Heartbeat())  # the gateway's own, so the worker hears it too
            _, beat = gateway.receive(Heartbeat, timeout=0.3)
            if engine.steps == 1:
                seen.append((time.monotonic() - start, beat.running, beat.waiting))
        assert len(seen) >= 8 and all(b - a < 0.3 for (a, *_), (b, *_) in zip(seen, seen[1:])), seen
        assert seen[-1][1:] == (1, 1), "the running request, and the one that arrived during the step"
        wait_until(lambda: [r.request_id for r in engine.pending] == ["long", "late"], 1, "the next step")
        assert set(proc.owner) == {"long", "late"}, "no gateway was judged silent"
    finally:
        proc.stopping = True
        thread.join(5)
        gateway.close()
