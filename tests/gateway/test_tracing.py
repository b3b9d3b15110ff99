"""gateway.ops.tracing on its own: the OTLP/HTTP export (to a real local HTTP server that records what it
gets), the flags, the off path, and the span helpers' shape (parentage, worker events, resumes)."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from common.config import add_flags, from_namespace
from common.protocol import NewRequest, RequestOutput, WorkerEvent
from gateway.config import ALL_GATEWAY_FLAGS, GatewayConfig
from gateway.ops import tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Collector:
    """A local OTLP/HTTP 'collector': records each POST (path, content type, body)."""

    def __init__(self) -> None:
        self.posts: list[tuple[str, str, bytes]] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                posts.append((self.path, self.headers.get("Content-Type", ""), body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list:
        """Every span of every export POST to /v1/traces, decoded, with its resource attributes."""
        out = []
        for path, _, body in self.posts:
            if path == "/v1/traces":
                for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
                    resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                    out.extend((resource, span) for scope in resource_spans.scope_spans for span in scope.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    c = Collector()
    yield c
    tracing.shutdown()
    c.close()


@pytest.fixture
def memory(collector: Collector) -> Iterator[InMemorySpanExporter]:
    """Tracing on (exporting to the local collector), every finished span also kept in memory."""
    provider = tracing.setup(collector.url, "test-gateway")
    assert provider is not None
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter


def scope(path: str = "/v1/chat/completions", headers: dict[str, str] | None = None, method: str = "POST") -> dict:
    raw = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return {"type": "http", "method": method, "path": path, "headers": raw}


def serve(scope: dict, handler) -> list[dict]:  # an async function run as the route
    """Run ``handler`` as the app behind the tracing middleware; the messages it sent."""
    sent: list[dict] = []

    async def app(scope: dict, receive, send) -> None:
        await handler()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    asyncio.run(tracing.middleware(app)(scope, receive, send))
    return sent


def test_a_bare_collector_address_gets_the_traces_path():
    assert tracing.traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert tracing.traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    with pytest.raises(ValueError, match="otlp-endpoint"):
        tracing.traces_url("collector:4318")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()  # as gateway.__main__ builds it
    add_flags(parser, "gateway", ALL_GATEWAY_FLAGS)
    return parser


def test_the_flags_reach_the_config():
    args = build_parser().parse_args(["--otlp-endpoint", "http://collector:4318", "--otlp-service-name", "edge-gw"])
    config = from_namespace(GatewayConfig, args)
    assert (config.otlp_endpoint, config.otlp_service_name) == ("http://collector:4318", "edge-gw")
    assert from_namespace(GatewayConfig, build_parser().parse_args([])).otlp_endpoint is None


def test_without_an_endpoint_nothing_is_traced():
    assert tracing.setup(None, "x") is None and tracing.provider() is None
    new = NewRequest("r1", [1, 2, 3], 4)

    async def route() -> None:
        with tracing.span("queue") as span:
            assert span is None
        generation = tracing.generation(new)
        generation.output(RequestOutput("r1", [5], "stop", 3, 1))
        generation.end("stop")

    serve(scope(headers={"traceparent": TRACEPARENT}), route)
    assert new.trace_context == {}  # no carrier was built


def test_an_otlp_endpoint_exports_the_spans_over_http(collector: Collector):
    tracing.setup(collector.url, "edge-gateway")

    async def route() -> None:
        with tracing.span("queue"):
            pass
        generation = tracing.generation(NewRequest("r1", [1, 2, 3], 4))
        generation.output(RequestOutput("r1", [5], "stop", 3, 1))
        generation.end("stop")

    serve(scope(headers={"traceparent": TRACEPARENT}), route)
    tracing.shutdown()  # flushes the batch
    posts = [(path, kind) for path, kind, _ in collector.posts]
    assert posts and set(posts) == {("/v1/traces", "application/x-protobuf")}
    spans = collector.spans()
    assert {span.name for _, span in spans} == {"POST /v1/chat/completions", "queue", "generate"}
    assert {resource["service.name"] for resource, _ in spans} == {"edge-gateway"}
    assert {span.trace_id.hex() for _, span in spans} == {TRACE_ID}


def test_one_request_is_one_trace_under_the_callers_span(memory: InMemorySpanExporter):
    news = [NewRequest("r1", [1, 2, 3], 4), NewRequest("r1-1", [1, 2, 3], 4)]

    async def route() -> None:
        with tracing.span("template+tokenize"):
            pass
        with tracing.span("queue"):
            pass
        generations = [tracing.generation(new) for new in news]
        generations[0].assigned("w-a")  # what dispatch tells the trace on a request's stream
        generations[1].assigned("w-b")
        generations[0].worker_events([WorkerEvent("admitted", 1_700_000_000_000_000_000, {"waited_steps": 2})], "w-a")
        generations[0].resumed("worker w-a missed 5 heartbeats", 1, 1)
        generations[0].assigned("w-b")
        for generation, reason in zip(generations, ("stop", "length")):
            generation.output(RequestOutput("x", [5], None, 3, 1, 2))
            generation.output(RequestOutput("x", [6], reason, 3, 2, 2))
            generation.end(reason)

    sent = serve(scope(headers={"traceparent": TRACEPARENT, "user-agent": "pytest"}), route)
    assert sent[0]["status"] == 200
    spans = {span.name: span for span in memory.get_finished_spans() if span.name != "generate"}
    generates = [span for span in memory.get_finished_spans() if span.name == "generate"]
    root = spans["POST /v1/chat/completions"]
    assert root.kind == SpanKind.SERVER and root.parent.span_id == int(PARENT_ID, 16) and root.parent.is_remote
    assert {format(s.context.trace_id, "032x") for s in memory.get_finished_spans()} == {TRACE_ID}
    for child in [spans["template+tokenize"], spans["queue"], *generates]:
        assert child.parent.span_id == root.context.span_id
    assert root.attributes["http.response.status_code"] == 200 and root.attributes["user_agent.original"] == "pytest"
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    assert root.attributes["gen_ai.response.finish_reasons"] == ("stop", "length")
    first = next(g for g in generates if g.attributes["llmpool.request_id"] == "r1")
    assert first.kind == SpanKind.CLIENT and first.attributes[tracing.WORKER_NAME] == "w-b"  # where it ended up
    assert [e.name for e in first.events] == ["admitted", "resumed_elsewhere", "first_token", "finish"]
    admitted, resumed = first.events[0], first.events[1]
    assert admitted.timestamp == 1_700_000_000_000_000_000 and dict(admitted.attributes) == {
        "waited_steps": 2,
        tracing.WORKER_NAME: "w-a",
    }
    assert (
        resumed.attributes["reason"] == "worker w-a missed 5 heartbeats" and resumed.attributes["llmpool.attempt"] == 1
    )
    assert first.attributes["gen_ai.usage.cache_read.input_tokens"] == 2
    # The worker got the generate span's context.
    for new, generation in zip(news, sorted(generates, key=lambda g: g.attributes["llmpool.request_id"])):
        assert new.trace_context["traceparent"] == f"00-{TRACE_ID}-{generation.context.span_id:016x}-01"


def test_other_routes_and_failed_choices(memory: InMemorySpanExporter):
    serve(scope("/v1/models", method="GET"), _nothing)
    serve(scope("/tokenize"), _nothing)
    assert memory.get_finished_spans() == ()

    async def failing() -> None:
        generation = tracing.generation(NewRequest("r2", [1], 4))
        generation.output(RuntimeError("the worker failed this request"))
        generation.end("error")

    serve(scope("/v1/completions/"), failing)
    spans = {span.name: span for span in memory.get_finished_spans()}
    assert set(spans) == {"POST /v1/completions", "generate"}  # a fresh trace: no traceparent came
    assert spans["POST /v1/completions"].parent is None
    assert spans["POST /v1/completions"].attributes["gen_ai.operation.name"] == "text_completion"
    assert spans["generate"].status.description == "the worker failed this request"
    assert spans["generate"].attributes["llmpool.outcome"] == "error"


async def _nothing() -> None:
    pass
