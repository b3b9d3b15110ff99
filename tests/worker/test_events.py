"""Per-request worker events for the gateway's traces: recorded only for requests that carry a
trace context, and carried by the request's outputs, the last ones by its final output."""

import pytest

from common.model_source import resolve_model
from common.protocol import NewRequest, SamplingParams
from tests.worker.factories import drain
from worker.build import build_engine
from worker.config import WorkerConfig
from worker.engine import Engine

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
    [1, 4093, 198, 31530, 253, 1403, 21881, 563, 260, 5304, 30, 2, 198, 1, 520, 9531, 198],
]
TRACE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Prompts prefilled in chunks of at most 7 tokens, and so few blocks that requests get preempted."""
    return build_engine(
        resolve_model("SmolLM2-135M-Instruct"),
        WorkerConfig(kv_cache_memory="4MiB", block_size=4, max_num_batched_tokens=7),  # 22 float32 blocks
    )


def new(request_id: str, prompt: list[int], max_tokens: int = 30, traced: bool = True) -> NewRequest:
    sampling = SamplingParams(temperature=0)
    return NewRequest(request_id, prompt, max_tokens, sampling, ignore_eos=True, trace_context=TRACE if traced else {})


def names(outputs: list) -> list[str]:
    return [e.name for o in outputs for e in o.events]


def test_a_traced_request_reports_its_way_through_the_engine(engine):
    engine.add_request(new("t", PROMPTS[0]))
    engine.add_request(new("plain", PROMPTS[1], traced=False))
    out = drain(engine)
    events = [e for o in out["t"] for e in o.events]
    assert [e.name for e in events[:2]] == ["admitted", "scheduled"] and events[-1].name == "finished"
    assert events[0].attributes == {"prompt_tokens": len(PROMPTS[0])}
    assert events[-1].attributes == {"finish_reason": "length", "output_tokens": 30}
    assert out["t"][-1].events[-1].name == "finished", "the final output carries the last event"
    first_chunks = []
    for e in events:
        if e.name in ("scheduled", "resumed"):
            first_chunks.append([])
        elif e.name == "prefill_chunk":
            first_chunks[-1].append((e.attributes["start"], e.attributes["tokens"]))
    chunks = first_chunks[0]
    assert chunks[0][0] == 0 and all(tokens <= 7 for _, tokens in chunks)
    assert sum(tokens for _, tokens in chunks) == len(PROMPTS[0])  # the prompt, chunk after chunk
    assert all(a.time_unix_nano <= b.time_unix_nano for a, b in zip(events, events[1:]))
    assert all(not o.events for o in out["plain"]), "untraced requests record nothing"


def test_preemption_and_resumption_are_reported(engine):
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(new(f"r{i}", prompt, 40))
    out = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    preempted = [rid for rid, outputs in out.items() if "preempted" in names(outputs)]
    assert preempted
    for rid in preempted:
        sequence = names(out[rid])
        assert sequence.index("resumed") > sequence.index("preempted") and sequence[-1] == "finished"


def test_aborted_and_refused_requests_carry_their_events(engine):
    engine.add_request(new("a", PROMPTS[1]))
    engine.step()
    (aborted,) = engine.abort(["a"])
    assert aborted.events[-1].name == "finished" and aborted.events[-1].attributes["finish_reason"] == "abort"
    engine.add_request(new("bad", [1, 999999]))
    (refused,) = engine.step().outputs
    assert [e.name for e in refused.events] == ["admitted", "finished"] and refused.events[-1].attributes[
        "finish_reason"
    ] == "error"
    drain(engine)
