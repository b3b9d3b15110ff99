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
        ([bytes((PROTOCOL_VERSION, MsgType.ABORT)), msgspec.msgpack.encode({"request_ids": "nope"})], "bad ABORT payload"),
    ],
)
def test_malformed_frames_are_rejected(frames, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.decode(frames)


def test_payload_is_msgpack_not_pickle():
    payload = protocol.encode(Abort(["x"]))[1]
    assert msgspec.msgpack.decode(payload) == {"request_ids": ["x"]}


def test_an_add_requests_with_one_unreadable_request_is_salvaged_request_by_request():
    """A prompt of booleans fails the whole message; read alone, the good requests run and the bad
    one is named, so the worker can answer it."""
    good = NewRequest("good", [1, 2], 4, SamplingParams(logit_bias={5: 1.0}, seed=3), [7])
    frames = protocol.encode(AddRequests([good, NewRequest("bad", [1], 4), NewRequest("worse", [1], 4)]))
    payload = msgspec.msgpack.decode(frames[1])
    payload["requests"][1]["prompt_token_ids"] = [True, False]
    payload["requests"][2] = {"request_id": 42}  # no readable id: cannot be answered
    frames = [frames[0], msgspec.msgpack.encode(payload)]
    with pytest.raises(ProtocolError, match="Expected `int`, got `bool`"):
        protocol.decode(frames)
    salvaged, refused = protocol.salvage_requests(frames)
    assert salvaged == [good]
    assert [rid for rid, _ in refused] == ["bad"] and "Expected `int`, got `bool`" in refused[0][1]
    assert protocol.salvage_requests(protocol.encode(Abort(["x"]))) is None
    assert protocol.salvage_requests([frames[0], b"\xc1"]) is None


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
