"""Traces of generation requests across the hops (``--otlp-endpoint``): OpenTelemetry spans, exported over OTLP/HTTP.

One HTTP generation request is one trace (or joins the caller's, through its ``traceparent``)::

    POST /v1/chat/completions   SERVER; GenAI attributes (model, sampling, usage, finish reasons)
      template+tokenize         (``tokenize`` for a plain prompt)
      queue                     the admission wait
      generate                  one per choice (CLIENT), named by its worker: events first_token, the
                                worker's own (admitted, scheduled, prefill_chunk, preempted, resumed,
                                finished), resumed_elsewhere (moved to another worker), finish

The generate span's context travels to the worker in ``NewRequest.trace_context``; the worker sends
its events back in ``RequestOutput.events`` and they are recorded with their own timestamps.

Each choice's ``GenerationTrace`` rides on its request's stream (gateway/fleet/workers.py), so dispatch notes
where the request went (assigned, resumed, the worker's events) without a registry here. Off by
default: without an endpoint no tracer exists, every hook finds no request trace and returns a
shared no-op (``UNTRACED``) at once; no span, no carrier, no event is built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.fleet.workers import UNTRACED, Untraced

if TYPE_CHECKING:
    from common.protocol import NewRequest, RequestOutput, WorkerEvent

# The POST routes that generate, and their GenAI operation names.
GENERATION_PATHS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}
WORKER_NAME = "llmpool.worker.name"

_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate, whatever the global propagator is
_NOOP = nullcontext()
_provider: TracerProvider | None = None
_tracer: Tracer | None = None


class RequestTrace:
    """The SERVER span of one HTTP generation request, and the usage its choices add up to."""

    def __init__(self, tracer: Tracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.status = 500  # until the response starts
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reasons: list[str] = []

    def child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: dict[str, Any] | None = None) -> Span:
        return self.tracer.start_span(name, context=self.context, kind=kind, attributes=attributes)

    def choice_finished(self, reason: str, output_tokens: int, cached_tokens: int) -> None:
        self.output_tokens += output_tokens
        self.cached_tokens = max(self.cached_tokens, cached_tokens)  # a prompt's n copies share one prompt
        self.finish_reasons.append(reason)
        if self.span.is_recording():
            self.span.set_attributes(
                {
                    "gen_ai.usage.output_tokens": self.output_tokens,
                    "gen_ai.usage.cache_read.input_tokens": self.cached_tokens,
                    "gen_ai.response.finish_reasons": self.finish_reasons,
                }
            )

    def end(self) -> None:
        self.span.set_attribute("http.response.status_code", self.status)
        if self.status >= 400:
            self.span.set_attribute("error.type", str(self.status))
        if self.status >= 500:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()


_current: ContextVar[RequestTrace | None] = ContextVar("llmpool_request_trace", default=None)


class GenerationTrace:
    """The ``generate`` span of one choice (one wire request), from submission to its end."""

    def __init__(self, request: RequestTrace, new: NewRequest) -> None:
        self.request = request
        self.started_ns = time.time_ns()
        self.first_token = False
        self.error: str | None = None
        self.counts = (len(new.prompt_token_ids), 0, 0)  # prompt, output, cached tokens
        self.span = request.child(
            "generate",
            SpanKind.CLIENT,
            {
                "llmpool.request_id": new.request_id,
                "gen_ai.request.max_tokens": new.max_new_tokens,
                "gen_ai.usage.input_tokens": self.counts[0],
            },
        )
        _PROPAGATOR.inject(new.trace_context, context=trace.set_span_in_context(self.span))

    def assigned(self, worker_name: str) -> None:
        """Dispatch sent the request to a worker (at submission, or when resuming it)."""
        self.span.set_attribute(WORKER_NAME, worker_name)

    def resumed(self, reason: str, attempt: int, delivered_tokens: int) -> None:
        """The request moves to another worker (its worker died, lost an output, or never took it)."""
        attributes = {"reason": reason, "llmpool.attempt": attempt, "llmpool.delivered_tokens": delivered_tokens}
        self.span.add_event("resumed_elsewhere", attributes)

    def worker_events(self, events: list[WorkerEvent], worker_name: str) -> None:
        """What happened to the request inside its worker, as events at their own times."""
        for event in events:
            self.span.add_event(
                event.name, {**event.attributes, WORKER_NAME: worker_name}, timestamp=event.time_unix_nano
            )

    def output(self, item: RequestOutput | Exception) -> None:
        """An output from the worker (or the failure that ends the choice)."""
        if isinstance(item, Exception):
            self.error = str(item)
            return
        self.counts = (item.num_prompt_tokens, item.num_output_tokens, item.num_cached_tokens)
        if item.new_token_ids and not self.first_token:
            self.first_token = True
            now = time.time_ns()
            self.span.add_event(
                "first_token", {"gen_ai.response.time_to_first_chunk": (now - self.started_ns) / 1e9}, timestamp=now
            )

    def end(self, outcome: str) -> None:
        """``outcome``: the finish reason (stop, length), or cancelled, timeout, error."""
        prompt, output, cached = self.counts
        usage = {
            "gen_ai.usage.input_tokens": prompt,
            "gen_ai.usage.output_tokens": output,
            "gen_ai.usage.cache_read.input_tokens": cached,
        }
        self.span.set_attributes(usage)
        if outcome in ("cancelled", "timeout", "error"):
            self.span.set_attribute("llmpool.outcome", outcome)
            if outcome != "cancelled":
                self.span.set_status(Status(StatusCode.ERROR, self.error or outcome))
        else:
            self.span.set_attribute("gen_ai.response.finish_reasons", [outcome])
            self.span.add_event("finish", {"gen_ai.response.finish_reasons": [outcome], **usage})
            self.request.choice_finished(outcome, output, cached)
        self.span.end()


# ---- setup -------------------------------------------------------------------------------------


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL: a bare collector address (http://collector:4318) gets /v1/traces."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(
            f"--otlp-endpoint must be an http:// or https:// URL (an OTLP/HTTP collector); got {endpoint!r}"
        )
    return endpoint.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else endpoint


def setup(endpoint: str | None, service_name: str) -> TracerProvider | None:
    """Start exporting spans to ``endpoint`` in batches (a background thread); None turns tracing off."""
    global _provider, _tracer
    shutdown()
    if not endpoint:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
    _provider, _tracer = provider, provider.get_tracer("llmpool.gateway")
    return provider


def provider() -> TracerProvider | None:
    return _provider


def shutdown() -> None:
    """Flush what is left and stop exporting (at gateway shutdown)."""
    global _provider, _tracer
    if _provider is not None:
        _provider.shutdown()
    _provider = _tracer = None


# ---- hooks -------------------------------------------------------------------------------------


def middleware(app: Any) -> Any:
    """ASGI middleware: the SERVER span of each generation request, child of the caller's
    ``traceparent`` when it sends one; other routes, and everything while tracing is off, pass through."""

    async def traced(scope: dict, receive: Any, send: Any) -> None:
        tracer = _tracer
        if tracer is None or scope["type"] != "http" or scope["method"] != "POST":
            return await app(scope, receive, send)
        path = scope["path"].rstrip("/")
        operation = GENERATION_PATHS.get(path)
        if operation is None:
            return await app(scope, receive, send)
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k in (b"traceparent", b"tracestate", b"user-agent")
        }
        attributes = {
            "http.request.method": "POST",
            "http.route": path,
            "url.path": scope["path"],
            "gen_ai.operation.name": operation,
        }
        if "user-agent" in headers:
            attributes["user_agent.original"] = headers["user-agent"]
        span = tracer.start_span(
            f"POST {path}", context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER, attributes=attributes
        )
        request = RequestTrace(tracer, span)
        token = _current.set(request)

        async def send_traced(message: dict) -> None:
            if message["type"] == "http.response.start":
                request.status = message["status"]
            await send(message)

        try:
            await app(scope, receive, send_traced)
        except Exception as exc:
            span.record_exception(exc)
            raise
        finally:
            _current.reset(token)
            request.end()

    return traced


def describe_request(attributes: Callable[[], dict[str, Any]]) -> None:
    """GenAI request attributes on the request span, once the request is checked and tokenized
    (``attributes`` is called only when the request is traced)."""
    request = _current.get()
    if request is None:
        return
    request.span.set_attributes(attributes())


class _Child:
    """A child span of the request span for the duration of a ``with`` block."""

    __slots__ = ("request", "name", "span")

    def __init__(self, request: RequestTrace, name: str) -> None:
        self.request = request
        self.name = name

    def __enter__(self) -> Span:
        self.span = self.request.child(self.name)
        return self.span

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, Exception):
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, str(exc)))
        self.span.end()


def span(name: str) -> Any:
    """``with span("queue"):``: a child of the current request's span (a no-op while tracing is off)."""
    request = _current.get()
    return _NOOP if request is None else _Child(request, name)


def generation(new: NewRequest) -> GenerationTrace | Untraced:
    """Open the ``generate`` span of a wire request about to be submitted, and put its context in
    ``new.trace_context`` for the worker. Call ``output`` with each output and ``end`` once."""
    request = _current.get()
    return UNTRACED if request is None else GenerationTrace(request, new)
