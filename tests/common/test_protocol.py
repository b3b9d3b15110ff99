"""The wire protocol: every message survives a round trip; anything malformed is a ProtocolError."""

import msgspec
import pytest

from common import protocol
from common.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequests,
    Goodbye,
    Heartbeat,
    MsgType,
    NewRequest,
    ProtocolError,
    Ready,
    RequestOutput,
    SamplingParams,
    StepOutputs,
    WorkerError,
)
from common.salvage import salvage_requests

MESSAGES = [
    Ready("w0", "m", 8192, 46592, 16, 128, "cpu", "bfloat16"),
    Heartbeat(running=3, waiting=1, free_blocks=10, total_blocks=20, tokens_per_s=12.5, steps=7, peak_batch_size=4),
    AddRequests([NewRequest("r1", [1, 2, 3], 16, SamplingParams(0.7, 0.9, 40, 1234), [5], True)]),
    Abort(["r1", "r2"]),
    StepOutputs([RequestOutput("r1", [42], "stop", 3, 1, 0)], batch_size=2, num_tokens=5),
    WorkerError("boom", "r1"),
    Goodbye("bye"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = protocol.encode(msg)
    assert frames[0] == bytes((PROTOCOL_VERSION, protocol._TYPE_OF[type(msg)]))
    assert protocol.decode(frames) == msg


@pytest.mark.parametrize(
    "frames, reason",
    [
        ([b"\x01\x02"], "expected 2 frames"),
        ([b"\x01", b""], "header must be 2 bytes"),
        ([bytes((99, MsgType.HEARTBEAT)), msgspec.msgpack.encode({})], "protocol version 99"),
        ([bytes((PROTOCOL_VERSION, 200)), b""], "unknown message type 200"),
        ([bytes((PROTOCOL_VERSION, MsgType.ABORT)), b"\xc1garbage"], "bad ABORT payload"),
        ([bytes((PROTOCOL_VERSION, MsgType.ABORT)), msgspec.msgpack.encode(["nope"])], "bad ABORT payload"),
        (
            [bytes((PROTOCOL_VERSION, MsgType.ABORT)), msgspec.msgpack.encode({"request_ids": ["x"]})],
            "bad ABORT payload",
        ),
    ],
)
def test_malformed_frames_are_rejected(frames, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frames)


def test_payload_is_msgpack_arrays_not_pickle():
    payload = protocol.encode(Abort(["x"]))[1]
    assert msgspec.msgpack.decode(payload) == [["x"]]


def test_a_one_token_output_is_compact():
    """Array form: a step's one-token output of a 32-character request id is its values without their
    names (the dataclasses with key names took 232 bytes); a shorter array takes the defaults."""
    rid = "0123456789abcdef0123456789abcdef"
    frames = protocol.encode(
        StepOutputs([RequestOutput(rid, [1234], None, 25, 7, 0, seq=6)], batch_size=1, num_tokens=1)
    )
    assert msgspec.msgpack.decode(frames[1]) == [
        [[rid, [1234], None, 25, 7, 0, None, False, None, None, 6, [], None]],
        1,
        1,
    ]
    assert sum(map(len, frames)) == 56  # 55 before ``pooled`` (a pooling request's vector) came at the end
    short = protocol.decode([frames[0], msgspec.msgpack.encode([[[rid, [1234]]]])])
    assert short == StepOutputs([RequestOutput(rid, [1234])])


def test_a_peer_of_the_old_version_is_named_and_refused_in_its_own_words():
    """Version 1 sent maps: its Ready's worker name is read for the log, and the refusal goes back as
    the map a version-1 worker decodes as its WorkerError."""
    old_ready = [
        bytes((1, MsgType.READY)),
        msgspec.msgpack.encode({"worker_name": "old-w", "model": "m", "protocol_version": 1}),
    ]
    with pytest.raises(protocol.VersionMismatch) as caught:
        protocol.decode(old_ready)
    assert (caught.value.version, caught.value.msg_type, caught.value.sender_name()) == (1, MsgType.READY, "old-w")
    header, payload = protocol.refusal(1, "speak 2")
    assert header == bytes((1, MsgType.ERROR)) and msgspec.msgpack.decode(payload) == {
        "message": "speak 2",
        "request_id": None,
    }
    assert protocol.decode(protocol.refusal(PROTOCOL_VERSION, "x")) == WorkerError("x")
    assert protocol.refusal(PROTOCOL_VERSION + 1, "x") is None


def test_an_add_requests_with_one_unreadable_request_is_salvaged_request_by_request():
    """A prompt of booleans fails the whole message; read alone, the good requests run and the bad
    one is named, so the worker can answer it."""
    good = NewRequest("good", [1, 2], 4, SamplingParams(logit_bias={5: 1.0}, seed=3), [7])
    frames = protocol.encode(AddRequests([good, NewRequest("bad", [1], 4), NewRequest("worse", [1], 4)]))
    payload = msgspec.msgpack.decode(frames[1])
    payload[0][1][1] = [True, False]  # the second request's prompt_token_ids
    payload[0][2] = [42]  # no readable id: cannot be answered
    frames = [frames[0], msgspec.msgpack.encode(payload)]
    with pytest.raises(ProtocolError, match="Expected `int`, got `bool`"):
        protocol.decode(frames)
    salvaged, refused = salvage_requests(frames)
    assert salvaged == [good]
    assert [rid for rid, _ in refused] == ["bad"] and "Expected `int`, got `bool`" in refused[0][1]
    assert salvage_requests(protocol.encode(Abort(["x"]))) is None
    assert salvage_requests([frames[0], b"\xc1"]) is None


def test_handshake_event_numbers_are_libzmqs():
    import zmq

    assert protocol.HANDSHAKE_SUCCEEDED == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert set(protocol.HANDSHAKE_EVENTS) == {
        zmq.EVENT_HANDSHAKE_SUCCEEDED,
        zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    }
    assert "not authorized" in protocol.HANDSHAKE_EVENTS[zmq.EVENT_HANDSHAKE_FAILED_AUTH]
