"""Traces across the hops, on real requests: the gateway app in this process (so its spans can be read
from an in-memory exporter beside the OTLP/HTTP one, which posts to a local recording server) and a
real worker process over real ZeroMQ."""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from common import protocol
from gateway.config import GatewayConfig
from gateway.http.app import create_app
from gateway.ops import tracing
from tests.conftest import MODEL, STATE_DIR, free_port, spawn, stop, wait_until, worker_argv
from tests.gateway.test_tracing import Collector

WORKER = "trace-w"
# The gateway shares this process (and two busy cores) with the test: a long pause must not read as a
# dead peer on either side. A SIGKILLed worker is still found at once (its socket closes).
PATIENT = {"LLMPOOL_HEARTBEAT_LIVENESS": "20"}
REQUEST_SPANS = ("POST /v1/chat/completions", "POST /v1/completions")


@dataclass
class Gateway:
    url: str
    collector: Collector
    memory: InMemorySpanExporter
    zmq: str
    workers: dict[str, subprocess.Popen]

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=headers, timeout=120)

    def spans(self, generations: int = 0) -> list[ReadableSpan]:
        """The finished spans, once the request span and ``generations`` generate spans ended (the
        request span ends just after the last byte is sent, so it may trail the response)."""

        def done() -> bool:
            names = [s.name for s in self.memory.get_finished_spans()]
            return any(n in REQUEST_SPANS for n in names) and names.count("generate") >= generations

        wait_until(done, 10, "the request's spans")
        return list(self.memory.get_finished_spans())


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    """This process serves the app (uvicorn in a thread, tracing to a local collector); one worker process."""
    collector = Collector()
    port, zmq = free_port(), f"tcp://127.0.0.1:{free_port()}"
    workers = {WORKER: spawn(worker_argv(zmq, WORKER), "tracing-worker", PATIENT)}
    config = GatewayConfig(
        heartbeat_liveness=20,
        port=port,
        zmq_bind=zmq,
        ui=False,
        otlp_endpoint=collector.url,
        otlp_service_name="llmpool-test",
        state_url=f"sqlite:///{STATE_DIR}/tracing.db",  # this run's, not the user's cache directory's
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_config=None, access_log=False)
    )
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: len(httpx.get(url + "/workers", timeout=5).json()["workers"]) == 1, 180, "the worker to register"
        )
        wait_until(lambda: httpx.get(url + "/v1/models", timeout=5).json()["data"], 60, "the model's tokenizer")
        provider = tracing.provider()
        assert provider is not None, "--otlp-endpoint set: the gateway's lifespan starts tracing"
        memory = InMemorySpanExporter()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        yield Gateway(url, collector, memory, zmq, workers)
    finally:
        server.should_exit = True
        thread.join(30)
        for worker in workers.values():
            stop(worker)
        tracing.shutdown()
        collector.close()


@pytest.fixture
def wire(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> list[protocol.Message]:
    """Every message the gateway sends or receives on its ZeroMQ socket during the test."""
    gateway.memory.clear()
    seen: list[protocol.Message] = []
    encode, decode = protocol.encode, protocol.decode

    def spy_encode(msg: protocol.Message) -> list[bytes]:
        seen.append(msg)
        return encode(msg)

    def spy_decode(frames: list) -> protocol.Message:
        msg = decode(frames)
        seen.append(msg)
        return msg

    monkeypatch.setattr(protocol, "encode", spy_encode)
    monkeypatch.setattr(protocol, "decode", spy_decode)
    return seen


def sent_requests(wire: list[protocol.Message]) -> list[protocol.NewRequest]:
    return [r for m in wire if isinstance(m, protocol.AddRequests) for r in m.requests]


def worker_events(wire: list[protocol.Message]) -> list[protocol.WorkerEvent]:
    return [e for m in wire if isinstance(m, protocol.StepOutputs) for o in m.outputs for e in o.events]


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Name three colours."}],
    "max_tokens": 6,
    "temperature": 0,
}


def test_a_chat_request_is_one_trace_from_the_caller_through_the_worker(gateway: Gateway, wire: list):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    reply = gateway.post(
        "/v1/chat/completions", CHAT, {"traceparent": f"00-{trace_id}-{parent_id}-01", "tracestate": "vendor=1"}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    spans = gateway.spans(generations=1)
    assert sorted(s.name for s in spans) == ["POST /v1/chat/completions", "generate", "queue", "template+tokenize"]
    (root,) = by_name(spans, "POST /v1/chat/completions")
    (generate,) = by_name(spans, "generate")

    # One trace, under the caller's span; every other span a child of the request's.
    assert {format(s.context.trace_id, "032x") for s in spans} == {trace_id}
    assert root.kind == SpanKind.SERVER and root.parent.is_remote and format(root.parent.span_id, "016x") == parent_id
    assert all(s.parent.span_id == root.context.span_id for s in spans if s is not root)
    assert root.start_time <= min(s.start_time for s in spans) and max(s.end_time for s in spans) == root.end_time

    usage = body["usage"]
    expected = {
        "http.response.status_code": 200,
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.model": MODEL,
        "gen_ai.request.max_tokens": 6,
        "gen_ai.request.temperature": 0,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.response.finish_reasons": (body["choices"][0]["finish_reason"],),
        "llmpool.request_id": reply.headers["x-request-id"],
    }
    assert {k: root.attributes.get(k) for k in expected} == expected
    assert generate.kind == SpanKind.CLIENT and generate.attributes[tracing.WORKER_NAME] == WORKER
    assert generate.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]

    # The worker got the generate span's context with the request.
    sends = sent_requests(wire)
    assert len(sends) == 1, (sends, [(e.name, dict(e.attributes)) for e in generate.events])
    sent = sends[0]
    assert sent.trace_context == {
        "traceparent": f"00-{trace_id}-{generate.context.span_id:016x}-01",
        "tracestate": "vendor=1",
    }
    names = [e.name for e in generate.events]
    assert names.index("first_token") < names.index("finish") == len(names) - 1

    # The same spans went out over OTLP/HTTP to the collector.
    tracing.provider().force_flush()
    exported = {
        (span.name, resource["service.name"])
        for resource, span in gateway.collector.spans()
        if span.trace_id.hex() == trace_id
    }
    assert exported == {(s.name, "llmpool-test") for s in spans}


def test_the_workers_events_join_the_generate_span(gateway: Gateway, wire: list):
    reply = gateway.post(
        "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "Count to three. " * 40}]}
    )
    assert reply.status_code == 200, reply.text
    (generate,) = by_name(gateway.spans(generations=1), "generate")
    events = worker_events(wire)
    names = [e.name for e in events]
    assert names[0] == "admitted" and names[-1] == "finished" and "prefill_chunk" in names, names
    # Each at its own time, inside the generate span (the worker ran between the submission and the end).
    recorded = [e for e in generate.events if e.name not in ("first_token", "finish")]
    assert [(e.name, e.timestamp) for e in recorded] == [(e.name, e.time_unix_nano) for e in events]
    assert all(
        e.attributes[tracing.WORKER_NAME] == WORKER and generate.start_time < e.timestamp < generate.end_time
        for e in recorded
    )
    first_token = next(e for e in generate.events if e.name == "first_token")
    assert recorded[0].timestamp < first_token.timestamp


def test_a_streamed_request_with_two_choices(gateway: Gateway, wire: list):
    body = {**CHAT, "stream": True, "n": 2, "temperature": 0.8, "seed": 7, "stream_options": {"include_usage": True}}
    chunks = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    spans = gateway.spans(generations=2)
    (root,) = by_name(spans, "POST /v1/chat/completions")
    generates = by_name(spans, "generate")
    assert root.parent is None and len(generates) == 2  # no traceparent came: a trace of its own
    assert all(
        s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id
        for s in spans
        if s is not root
    )
    assert root.attributes["gen_ai.request.stream"] is True and root.attributes["gen_ai.request.choice.count"] == 2
    usage = chunks[-1]["usage"]
    assert root.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    finishes = sorted(
        c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")
    )
    assert sorted(root.attributes["gen_ai.response.finish_reasons"]) == finishes
    assert sorted(g.attributes["llmpool.request_id"] for g in generates) == sorted(
        r.request_id for r in sent_requests(wire)
    )
    for generate in generates:
        assert "first_token" in [e.name for e in generate.events] and generate.attributes[tracing.WORKER_NAME] == WORKER


def test_a_completion_request_has_a_tokenize_span(gateway: Gateway, wire: list):
    reply = gateway.post("/v1/completions", {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    spans = gateway.spans(generations=1)
    assert sorted(s.name for s in spans) == ["POST /v1/completions", "generate", "queue", "tokenize"]
    (root,) = by_name(spans, "POST /v1/completions")
    assert root.attributes["gen_ai.operation.name"] == "text_completion"
    assert root.attributes["gen_ai.usage.input_tokens"] == reply.json()["usage"]["prompt_tokens"]


def test_a_refused_request_is_a_span_with_its_status(gateway: Gateway, wire: list):
    reply = gateway.post("/v1/chat/completions", {**CHAT, "max_tokens": -1})
    assert reply.status_code == 400
    spans = gateway.spans()
    assert sorted(s.name for s in spans) == [
        "POST /v1/chat/completions",
        "template+tokenize",
    ]  # refused before the queue
    (root,) = by_name(spans, "POST /v1/chat/completions")
    assert root.attributes["http.response.status_code"] == 400 and root.attributes["error.type"] == "400"
    assert sent_requests(wire) == []


def test_a_request_resumed_on_another_worker_stays_one_generate_span(gateway: Gateway, wire: list):
    """SIGKILL the worker serving a stream: the generate span records the move and both workers' events."""
    other = "trace-w2"
    gateway.workers[other] = spawn(worker_argv(gateway.zmq, other), "tracing-worker-2", PATIENT)
    wait_until(
        lambda: len(httpx.get(gateway.url + "/workers", timeout=5).json()["workers"]) == 2, 180, "the second worker"
    )
    gateway.memory.clear()
    wire.clear()
    body = {**CHAT, "stream": True, "max_tokens": 48, "ignore_eos": True}
    killed = []
    with httpx.stream("POST", gateway.url + "/v1/chat/completions", json=body, timeout=120) as reply:
        for count, line in enumerate(reply.iter_lines()):
            if count == 12 and not killed:
                (busy,) = [
                    w["name"] for w in httpx.get(gateway.url + "/workers", timeout=5).json()["workers"] if w["inflight"]
                ]
                gateway.workers[busy].send_signal(signal.SIGKILL)
                killed.append(busy)
    assert killed, "the stream ended before a worker could be killed"
    (survivor,) = {WORKER, other} - set(killed)
    (generate,) = by_name(gateway.spans(generations=1), "generate")
    assert (
        generate.attributes[tracing.WORKER_NAME] == survivor and generate.attributes["gen_ai.usage.output_tokens"] == 48
    )
    (moved,) = [e for e in generate.events if e.name == "resumed_elsewhere"]
    assert killed[0] in moved.attributes["reason"] and moved.attributes["llmpool.attempt"] == 1
    admitted = [e.attributes[tracing.WORKER_NAME] for e in generate.events if e.name == "admitted"]
    assert admitted == [killed[0], survivor]
    resumed = [r for r in sent_requests(wire) if r.resumed_tokens]
    assert (
        len(resumed) == 1
        and resumed[0].trace_context["traceparent"].split("-")[2] == f"{generate.context.span_id:016x}"
    )


def test_with_tracing_off_nothing_is_created(gateway: Gateway, wire: list, monkeypatch: pytest.MonkeyPatch):
    """Last in this module: it turns tracing off, as a gateway without --otlp-endpoint has it."""
    from opentelemetry.sdk.trace import Tracer

    started: list[str] = []
    start_span: Callable = Tracer.start_span
    monkeypatch.setattr(
        Tracer, "start_span", lambda self, name, *a, **k: started.append(name) or start_span(self, name, *a, **k)
    )
    tracing.setup(None, "off")
    before = finished_generations(gateway)
    for stream in (False, True):
        reply = gateway.post("/v1/chat/completions", {**CHAT, "stream": stream})
        assert reply.status_code == 200
    # A generation's trace ends in the same step as its metrics count it: wait for the count.
    wait_until(lambda: finished_generations(gateway) == before + 2, 10, "both generations to end")
    assert started == [] and gateway.memory.get_finished_spans() == ()
    assert [r.trace_context for r in sent_requests(wire)] == [{}, {}]
    assert worker_events(wire) == []  # an untraced request brings no events back


def finished_generations(gateway: Gateway) -> float:
    text = httpx.get(gateway.url + "/metrics", timeout=5).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "llmpool_generations"
        for s in f.samples
        if s.name.endswith("_total")
    )
