"""Dispatch with no sockets and no sleeps: decoded messages and a hand-turned clock in, messages in
the outbox and items on the request streams out."""

from __future__ import annotations

import pytest

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
from gateway.fleet.dispatch import Dispatcher
from gateway.fleet.roster import GATEWAY_HEARTBEAT
from gateway.fleet.workers import PrefixAffinity, RequestStream, WorkerInfo


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ready(name: str = "a", model: str = "m", digest: str = "") -> Ready:
    return Ready(name, model, 1024, 4096, 16, 8, "cpu", "float32", tokenizer_digest=digest)


def request(
    i: int, prompt: list[int] | None = None, budget: int = 4, sampling: SamplingParams | None = None
) -> NewRequest:
    return NewRequest(f"r{i}", prompt or [1, 2, 3], budget, sampling or SamplingParams())


class Pool:
    """A dispatcher (heartbeat interval 1 s, liveness 3), its clock, and the peers the ROUTER could
    still reach."""

    def __init__(self, **options: object) -> None:
        self.clock = Clock()
        self.reachable: set[bytes] = set()
        self.dispatch = Dispatcher(
            1.0, 3, reachable=lambda identity: identity in self.reachable, clock=self.clock, **options
        )

    def join(self, name: str = "a", model: str = "m", digest: str = "") -> bytes:
        identity = name.encode()
        self.reachable.add(identity)
        self.dispatch.on_message(identity, ready(name, model, digest))
        return identity

    def sent(self) -> list[tuple[bytes, object]]:
        """What the ROUTER side would send now (after the end-of-tick flush)."""
        self.dispatch.flush()
        out = list(self.dispatch.outbox)
        self.dispatch.outbox.clear()
        return out

    def step(self, identity: bytes, *outputs: RequestOutput, batch_size: int = 0) -> None:
        self.dispatch.on_message(identity, StepOutputs(list(outputs), batch_size=batch_size))

    def tick(self, seconds: float = 1.0) -> None:
        """The heartbeat loop's tick, ``seconds`` after the last (more than the interval: the
        process was paused, and the lateness is forgiven)."""
        self.clock.now += seconds
        self.dispatch.tick()


def drained(stream: RequestStream) -> list:
    items = []
    while not stream.queue.empty():
        items.append(stream.queue.get_nowait())
    return items


def test_the_requests_of_one_flush_travel_together_and_outputs_reach_their_streams():
    pool = Pool()
    a = pool.join("a")
    streams = [pool.dispatch.submit(request(i), "m") for i in range(3)]
    (sent,) = pool.sent()
    assert sent[0] == a and [r.request_id for r in sent[1].requests] == ["r0", "r1", "r2"]
    assert pool.dispatch.add_messages_sent == 1
    pool.step(a, RequestOutput("r0", [5], None, 3, 1), RequestOutput("r1", [6], "stop", 3, 1), batch_size=3)
    assert [o.new_token_ids for o in drained(streams[0])] == [[5]]
    assert drained(streams[1])[0].finish_reason == "stop" and streams[1].finished
    assert pool.dispatch.snapshot()["workers"][0]["peak_batch_size"] == 3
    pool.dispatch.abort("r0")
    assert pool.sent() == [(a, Abort(["r0"]))]
    pool.dispatch.submit(request(3), "m")
    pool.dispatch.abort("r3")  # not sent yet: dropped from the batch, no Abort
    assert pool.sent() == [] and pool.dispatch.snapshot()["workers"][0]["inflight"] == 1


def test_a_silent_worker_expires_its_requests_fail_after_waiting_for_another_and_submits_are_refused():
    pool = Pool()
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0), "m")
    pool.sent()
    for _ in range(3):
        pool.tick()
    assert pool.sent() == [(a, GATEWAY_HEARTBEAT)] * 3 and pool.dispatch.roster.workers  # 3 s of silence: alive
    pool.tick()  # past the 3 s expiry: purged; the request waits a liveness period for a worker
    assert not pool.dispatch.roster.workers and stream.queue.empty()
    for _ in range(4):
        pool.tick()
    (error,) = drained(stream)
    assert (
        isinstance(error, GenerationFailed)
        and "missed 3 heartbeats" in error.message
        and "no other worker" in error.message
    )
    with pytest.raises(NoWorkerAvailable, match="`m`"):
        pool.dispatch.submit(request(1), "m")
    assert pool.dispatch.snapshot()["departures"] == 1


def test_a_pause_of_the_gateway_counts_against_no_worker():
    """A tick that comes late (the gateway's process was stopped) moves every deadline by the
    lateness: the workers' messages waited in the socket, unread."""
    pool = Pool()
    pool.join("a")
    pool.tick(10.0)  # 9 s late: the 3 s deadline moves with it
    pool.tick()
    pool.tick()
    assert pool.dispatch.roster.workers
    pool.tick()  # then 3 s of real silence
    assert not pool.dispatch.roster.workers


def test_an_orphaned_request_resumes_on_the_next_worker_to_register():
    pool = Pool()
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0, budget=5), "m")
    pool.sent()
    pool.step(a, RequestOutput("r0", [7], None, 3, 1))
    pool.dispatch.on_message(a, Goodbye("restarting"))
    b = pool.join("b")  # within the liveness period
    ((to, added),) = pool.sent()
    assert to == b and added.requests[0].prompt_token_ids == [1, 2, 3, 7] and added.requests[0].request_id == "r0.1"
    assert not stream.finished


def test_heartbeats_keep_a_worker_alive_and_carry_its_load():
    pool = Pool()
    a = pool.join("a")
    for _ in range(5):  # 5 s, well past the 3 s expiry
        pool.dispatch.on_message(a, Heartbeat(running=2, free_blocks=10, total_blocks=20))
        pool.tick()
    assert pool.dispatch.snapshot()["workers"][0]["running"] == 2 and pool.sent() == [(a, GATEWAY_HEARTBEAT)] * 5


def test_requests_go_only_to_workers_of_their_model():
    pool = Pool()
    other = pool.join("other", model="not-m")
    with pytest.raises(NoWorkerAvailable, match="`m`"):
        pool.dispatch.submit(request(0), "m")
    a = pool.join("a")
    pool.dispatch.submit(request(1), "m")
    pool.dispatch.submit(request(2), "not-m")
    assert {to: [r.request_id for r in msg.requests] for to, msg in pool.sent()} == {a: ["r1"], other: ["r2"]}
    assert pool.dispatch.roster.limits("not-m") == (1024, 4096)


def test_a_worker_with_another_tokenizer_under_a_served_name_is_refused_and_told_why():
    pool = Pool()
    pool.join("a", digest="aaa")
    impostor = pool.join("impostor", digest="bbb")
    ((to, refusal),) = pool.sent()
    assert to == impostor and isinstance(refusal, WorkerError) and "tokenizer or chat template" in refusal.message
    assert list(pool.dispatch.roster.workers) == [b"a"]


def test_a_gateway_learns_a_model_from_its_first_worker_before_admitting_it():
    """A learning gateway: the worker waits in joining, is asked for its tokenizer (DescribeModel),
    and is admitted once the ROUTER side loaded what it sent; a failed load asks again."""
    pool = Pool(learns=True)
    a = pool.join("a", digest="d1")
    assert pool.sent() == [(a, DescribeModel("d1"))] and not pool.dispatch.roster.workers
    assert pool.dispatch.snapshot()["joining"] == [{"name": "a", "model": "m"}]
    broken = ModelInfo("m", "d1", b"broken")
    pool.dispatch.on_message(a, broken)
    assert pool.dispatch.to_learn == [(a, broken)]
    pool.dispatch.to_learn.clear()
    pool.dispatch.learned(a, broken, ValueError("not a tokenizer"))
    assert (
        not pool.dispatch.roster.workers
        and not pool.dispatch.roster.joining
        and pool.dispatch.roster.models["m"].digest is None
    )
    pool.join("a", digest="d1")  # it registers again and is asked again
    assert pool.sent() == [(a, DescribeModel("d1"))]
    good = ModelInfo("m", "d1", b"files")
    pool.dispatch.on_message(a, good)
    pool.dispatch.learned(a, good, None)
    assert list(pool.dispatch.roster.workers) == [a] and pool.dispatch.roster.models["m"].digest == "d1"
    pool.join("b", digest="d1")  # a second worker of a known model is admitted at once
    assert set(pool.dispatch.roster.workers) == {a, b"b"} and pool.sent() == []


def test_a_worker_twice_as_fast_gets_about_twice_the_work_and_like_workers_share():
    """Outstanding work is weighed by each worker's measured speed (capacity from its heartbeats)."""
    pool = Pool()
    fast, slow = pool.join("fast"), pool.join("slow")
    pool.dispatch.on_message(fast, Heartbeat(capacity_tokens_per_s=200.0))
    pool.dispatch.on_message(slow, Heartbeat(capacity_tokens_per_s=100.0))
    for i in range(30):
        pool.dispatch.submit(request(i), "m")
    shares = {w.ready.worker_name: len(w.inflight) for w in pool.dispatch.roster.workers.values()}
    assert sum(shares.values()) == 30 and 1.6 <= shares["fast"] / shares["slow"] <= 2.2, shares
    # Like workers whose figures differ by noise share the work instead of the faster taking all.
    pool.dispatch.on_message(slow, Heartbeat(capacity_tokens_per_s=185.0))
    for i in range(30):
        pool.dispatch.abort(f"r{i}")
    pool.clock.now += 2  # the pool's median speed is refreshed once a second
    for i in range(30, 40):
        pool.dispatch.submit(request(i), "m")
    assert {w.ready.worker_name: len(w.inflight) for w in pool.dispatch.roster.workers.values()} == {
        "fast": 5,
        "slow": 5,
    }


def test_a_worker_registering_again_replaces_its_old_entry_and_takes_its_requests_back():
    pool = Pool()
    old = pool.join("a")
    stream = pool.dispatch.submit(request(0), "m")
    pool.sent()
    pool.reachable.discard(old)  # the old process is gone, and its connection with it
    new = b"a-restarted"
    pool.dispatch.on_message(new, ready("a"))  # same worker_name, new identity: the same worker, restarted
    ((to, resent),) = pool.sent()
    assert to == new and [r.request_id for r in resent.requests] == ["r0.1"]  # each attempt has its own wire id
    assert list(pool.dispatch.roster.workers) == [new]
    pool.step(new, RequestOutput("r0.1", [9], "length", 3, 1))
    assert [o.new_token_ids for o in drained(stream)] == [[9]]


def test_a_second_live_worker_with_the_same_name_is_refused_and_told_why():
    pool = Pool()
    pool.join("a")
    pool.dispatch.on_message(b"twin", ready("a"))  # the first one's connection is open
    ((to, refusal),) = pool.sent()
    assert to == b"twin" and "another live worker is registered as 'a'" in refusal.message
    assert list(pool.dispatch.roster.workers) == [b"a"] and not pool.dispatch.roster.departed


def test_a_dead_workers_requests_resume_on_another_worker_where_they_left_off():
    pool = Pool()
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0, budget=5, sampling=SamplingParams(temperature=0.7, seed=11)), "m")
    assert [to for to, _ in pool.sent()] == [a]
    b = pool.join("b")
    pool.step(a, RequestOutput("r0", [7], None, 3, 1))
    pool.step(a, RequestOutput("r0", [8], None, 3, 2, seq=1))
    pool.dispatch.on_message(a, Goodbye("crashing"))
    ((to, added),) = pool.sent()
    moved = added.requests[0]
    assert (
        to == b
        and moved.prompt_token_ids == [1, 2, 3, 7, 8]
        and moved.max_new_tokens == 3
        and moved.resumed_tokens == 2
    )
    assert moved.sampling.temperature == 0.7 and moved.sampling.seed == 13
    pool.step(b, RequestOutput("r0.1", [9], "length", 5, 1))
    outputs = drained(stream)
    assert [o.new_token_ids for o in outputs] == [[7], [8], [9]]
    assert (outputs[-1].num_prompt_tokens, outputs[-1].num_output_tokens) == (3, 3) and pool.dispatch.resumed == 1


def test_a_worker_that_heartbeats_but_makes_no_progress_counts_as_hung():
    pool = Pool(hung_timeout=5.0)
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0), "m")
    pool.sent()
    ready_at = []
    for _ in range(6):  # heartbeats keep coming, tokens don't
        pool.dispatch.on_message(a, Heartbeat(running=1))
        ready_at.append(bool(pool.dispatch.ready_workers()))
        pool.tick()
    assert ready_at == [True, True, True, False, False, False]  # /ready drops it at half the timeout
    assert not pool.dispatch.roster.workers and "made no progress" in pool.dispatch.roster.departed[0]["reason"]
    pool.tick(4.0)
    (error,) = drained(stream)
    assert isinstance(error, GenerationFailed) and "made no progress for 5 s" in error.message


def test_a_request_the_worker_never_accepted_fails_alone_and_the_worker_is_not_hung():
    """The worker heartbeats that it holds nothing while the gateway counts a request on it (a
    message lost or unreadable): after ``liveness`` heartbeats the request is sent again (the
    resume path, max_retries times) and then ends with an error; the worker stays registered and
    ready, though hung_timeout passed many times meanwhile."""
    pool = Pool(hung_timeout=1.0)
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0), "m")
    sent = []
    for _ in range(15):
        pool.dispatch.on_message(a, Heartbeat())  # running 0, waiting 0
        pool.tick()
        assert pool.dispatch.ready_workers()
        sent += [msg.requests[0].request_id for _, msg in pool.sent() if isinstance(msg, AddRequests)]
    assert sent == ["r0", "r0.1", "r0.2"]
    (error,) = drained(stream)
    assert (
        isinstance(error, GenerationFailed)
        and "does not hold the request" in error.message
        and "moved 2 times" in error.message
    )
    assert (
        pool.dispatch.roster.workers
        and pool.dispatch.snapshot()["workers"][0]["inflight"] == 0
        and not pool.dispatch.roster.departed
    )


def test_a_lost_output_is_noticed_and_the_request_resumes_from_what_was_delivered():
    """The worker skips the output carrying token 8 (seq 1): seq 2 arrives where 1 was due, the old
    attempt is stopped, and the request goes again as prompt + the tokens delivered (under a new
    wire id, so the old attempt's late outputs can't mix in). The client reads 7 8 9 with no hole."""
    pool = Pool()
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0, budget=3, sampling=SamplingParams(temperature=0)), "m")
    pool.sent()
    pool.step(a, RequestOutput("r0", [7], None, 3, 1, seq=0))
    pool.step(a, RequestOutput("r0", [9], None, 3, 3, seq=2))  # seq 1 ([8]) lost
    (abort, (_, again)) = pool.sent()
    assert abort == (a, Abort(["r0"]))
    assert (again.requests[0].request_id, again.requests[0].prompt_token_ids, again.requests[0].max_new_tokens) == (
        "r0.1",
        [1, 2, 3, 7],
        2,
    )
    pool.step(a, RequestOutput("r0", [], "abort", 3, 3, seq=3))  # the old attempt's: ignored
    pool.step(a, RequestOutput("r0.1", [8], None, 4, 1, seq=0))
    pool.step(a, RequestOutput("r0.1", [9], "length", 4, 2, seq=1))
    outputs = drained(stream)
    assert [o.new_token_ids for o in outputs] == [[7], [8], [9]]
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 3
    assert stream.finished and pool.dispatch.resumed == 1


def test_a_request_taken_over_from_a_dead_gateway_continues_after_the_tokens_it_delivered():
    """``submit(..., delivered)`` (a Responses run taken over): the worker gets prompt + the
    delivered tokens with the rest of the budget, and the outputs count as if it had run here; with
    every token delivered it ends at its length at once and nothing is sent."""
    pool = Pool()
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0, budget=4), "m", delivered=[7, 8])
    ((_, message),) = pool.sent()
    (sent,) = message.requests
    assert (sent.request_id, sent.prompt_token_ids, sent.max_new_tokens, sent.resumed_tokens) == (
        "r0",
        [1, 2, 3, 7, 8],
        2,
        2,
    )
    pool.step(a, RequestOutput("r0", [9, 10], "length", 5, 2, seq=0))
    (output,) = drained(stream)
    assert (output.new_token_ids, output.num_prompt_tokens, output.num_output_tokens) == ([9, 10], 3, 4)
    assert stream.finished and not pool.dispatch.streams
    done = pool.dispatch.submit(request(1, budget=2), "m", delivered=[7, 8])
    assert pool.sent() == []
    (final,) = drained(done)
    assert (final.finish_reason, final.new_token_ids, final.num_prompt_tokens, final.num_output_tokens) == (
        "length",
        [],
        3,
        2,
    )
    assert done.finished and not pool.dispatch.streams and pool.dispatch.snapshot()["workers"][0]["inflight"] == 0


def test_a_worker_the_router_cannot_reach_is_purged():
    pool = Pool()
    a = pool.join("a")
    stream = pool.dispatch.submit(request(0), "m")
    pool.sent()
    pool.dispatch.unreachable(a, "Host unreachable")
    assert (
        not pool.dispatch.roster.workers
        and "unreachable (Host unreachable)" in pool.dispatch.roster.departed[0]["reason"]
    )
    assert not stream.finished  # waits for another worker


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def assigned(self, worker_name: str) -> None:
        self.calls.append(("assigned", worker_name))

    def resumed(self, reason: str, attempt: int, delivered_tokens: int) -> None:
        self.calls.append(("resumed", attempt, delivered_tokens))

    def worker_events(self, events: list, worker_name: str) -> None:
        self.calls.append(("events", [e.name for e in events], worker_name))


def test_dispatch_notes_where_a_request_went_on_its_own_trace():
    from common.protocol import WorkerEvent

    pool = Pool()
    a = pool.join("a")
    trace = Recorder()
    pool.dispatch.submit(request(0), "m", trace)  # type: ignore[arg-type]
    pool.sent()
    pool.step(a, RequestOutput("r0", [7], None, 3, 1, events=[WorkerEvent("admitted", 1)]))
    pool.join("b")
    pool.dispatch.on_message(a, Goodbye("bye"))
    assert trace.calls == [("assigned", "a"), ("events", ["admitted"], "a"), ("resumed", 1, 1), ("assigned", "b")]


def test_prefix_affinity_sends_a_shared_prefix_to_the_same_worker_unless_it_is_much_busier():
    a = WorkerInfo(b"a", ready("a"), 0.0)
    b = WorkerInfo(b"b", ready("b"), 0.0)
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
    a, b, c = (
        WorkerInfo(name, ready(name.decode()), 0.0, load=Heartbeat(kv_store_id="s1-fp")) for name in (b"a", b"b", b"c")
    )
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


def test_a_pinned_client_stays_on_its_first_worker_while_it_takes_requests():
    """A Responses WebSocket's pin: its requests follow the first one's worker, however busy, until
    that worker drains; then the pin moves to the next one chosen."""
    import contextvars

    from gateway.fleet.dispatch import PINNED, Pin

    pool = Pool(affinity_slack=None)
    pool.join("a"), pool.join("b")
    pin = Pin()

    def submit(i: int) -> bytes:
        return (
            contextvars.copy_context().run(lambda: (PINNED.set(pin), pool.dispatch.submit(request(i), "m"))[1]).worker
        )

    first = submit(0)
    assert {submit(i) for i in range(1, 6)} == {first}, "without the pin, load would spread them"
    assert pool.dispatch.submit(request(6), "m").worker != first, "unpinned requests spread as before"
    pool.dispatch.on_message(first, Heartbeat(draining=True))
    other = submit(7)
    assert other != first and pin.identity == other
