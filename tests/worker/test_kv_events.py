"""KV events (worker/kv_events.py) over a real ZeroMQ PUB/SUB pair: a subscriber that rebuilds the
worker's cached block set from them holds exactly what the block manager holds, through prefix
hits and evictions; the payload is vLLM's (tagged events in a timestamped batch). A subscriber that
joins late asks the replay socket (vLLM's ROUTER framing) for every batch from 0 and rebuilds the
same set."""

from __future__ import annotations

import time

import msgspec
import zmq

from common.protocol import NewRequest, SamplingParams
from tests.worker.fake_runner import FakeRunner
from worker.config import WorkerConfig
from worker.engine import Engine
from worker.kv_events import KvEventPublisher


def test_a_subscriber_rebuilds_the_block_set_from_the_events(tmp_path):
    engine = Engine(FakeRunner(num_blocks=8), WorkerConfig(block_size=4))
    publisher = KvEventPublisher(f"ipc://{tmp_path}/kv-events", topic="kv", replay_endpoint=f"ipc://{tmp_path}/replay")
    engine.blocks.events = publisher
    publisher.start()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(0.3)  # the subscription reaches the publisher before anything is sent

    shared = list(range(100, 108))
    prompts = [shared + [1, 2, 3], shared + [4, 5, 6], *[[i * 50 + j for j in range(1, 14)] for i in range(3, 8)]]
    prompts.append(shared + [1, 2, 3])  # evicted by now, or a hit: either way the sets must agree
    for i, prompt in enumerate(prompts):
        engine.add_request(NewRequest(f"r{i}", prompt, 3, SamplingParams(temperature=0)))
        while engine.has_work():
            engine.step()
            publisher.flush()  # as the worker's loop does after each step

    held, seqs, kinds = rebuild(sub, topic=b"kv", block_size=4)
    sub.close(linger=0)
    assert seqs == list(range(len(seqs))) and seqs
    assert kinds == {"AllBlocksCleared", "BlockStored", "BlockRemoved"}  # the small cache had to evict
    assert held == set(engine.blocks._cached) and engine.blocks.num_cached_blocks == len(held)
    assert engine.load().cached_blocks == len(held)  # what /workers shows as cached_blocks

    late = replayed(publisher.replay.endpoint, 0)
    assert [seq for seq, _ in late] == seqs and rebuild_from(late, block_size=4)[0] == held
    assert [seq for seq, _ in replayed(publisher.replay.endpoint, 3)] == seqs[3:]
    assert replayed(publisher.replay.endpoint, None) == []  # a malformed request gets the end marker alone
    publisher.close()


def replayed(endpoint: str, start: int | None) -> list[tuple[int, bytes]]:
    """What a replay socket answers a request for the batches from ``start`` (a malformed request
    when None), as a vLLM subscriber asks: a DEALER, so the empty delimiter is sent by hand."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", b"bad" if start is None else start.to_bytes(8, "big")])
    batches = []
    try:
        while True:
            assert dealer.poll(10_000), "no end marker from the replay socket"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def rebuild(
    sub: zmq.Socket, topic: bytes, block_size: int, wait_s: float = 1.0
) -> tuple[set[int], list[int], set[str]]:
    """The block hashes a subscriber holds after reading every batch sent (until ``wait_s`` of
    quiet), the batches' sequence numbers, and the event types seen."""
    batches = []
    while sub.poll(wait_s * 1000):
        got, seq, payload = sub.recv_multipart()
        assert got == topic
        batches.append((int.from_bytes(seq, "big"), payload))
    return rebuild_from(batches, block_size)


def rebuild_from(batches: list[tuple[int, bytes]], block_size: int) -> tuple[set[int], list[int], set[str]]:
    """The block hashes held after applying ``batches`` (sequence number, payload) in order."""
    held: set[int] = set()
    seqs, kinds = [], set()
    for seq, payload in batches:
        seqs.append(seq)
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw["ts"], float) and abs(raw["ts"] - time.time()) < 60
        for event in raw["events"]:
            kinds.add(event["type"])
            if event["type"] == "AllBlocksCleared":
                held.clear()
            elif event["type"] == "BlockStored":
                assert len(event["token_ids"]) == block_size * len(event["block_hashes"])
                assert event["block_size"] == block_size
                assert event["parent_block_hash"] is None or event["parent_block_hash"] in held
                held.update(event["block_hashes"])
            else:
                held.difference_update(event["block_hashes"])
    return held, seqs, kinds


def test_serve_gives_each_local_worker_its_own_event_ports():
    """``llmpool serve --workers N``: a bound tcp port (PUB and replay alike) is offset by the worker's
    index, as vLLM offsets its data-parallel ranks; other endpoints are left as given."""
    from launcher.cli import _own_events

    env = {"LLMPOOL_KV_EVENTS_ENDPOINT": "tcp://*:5557", "LLMPOOL_KV_EVENTS_REPLAY_ENDPOINT": "tcp://*:5600"}
    assert _own_events(env, 0) == {}
    assert _own_events(env, 2) == {
        "LLMPOOL_KV_EVENTS_ENDPOINT": "tcp://*:5559",
        "LLMPOOL_KV_EVENTS_REPLAY_ENDPOINT": "tcp://*:5602",
    }
    assert _own_events({"LLMPOOL_KV_EVENTS_ENDPOINT": "tcp://10.0.0.1:5557"}, 1) == {}  # connects: one subscriber
