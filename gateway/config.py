"""Gateway settings: each is a flag with an environment twin (see common.config)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from common.config import CACHE_DIR, SHARED_FLAGS, Flag, SharedConfig, parse_size


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``12h`` or ``30d``."""
    value = str(text).strip().lower()
    for suffix, scale in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * scale
    return float(value)


def default_state_url() -> str:
    """SQLite in the cache directory (``--cache-dir``'s twin, LLMPOOL_CACHE_DIR, is read here too)."""
    return "sqlite:///" + os.path.join(CACHE_DIR.env_default(), "state.db")


GATEWAY_FLAGS = [
    Flag("host", "127.0.0.1", "HTTP listen address (0.0.0.0 to accept other hosts)"),
    Flag("port", 8000, "HTTP port", int),
    Flag("zmq-bind", "tcp://127.0.0.1:5555", "Address the ROUTER socket binds for workers (tcp:// or ipc://)"),
    Flag(
        "api-key", None, "API key(s), comma-separated: every route but /health then wants `Authorization: Bearer KEY`"
    ),
    Flag("max-body-size", "4MiB", "Largest request body accepted; larger ones get 413"),
    Flag("max-header-size", "32KiB", "Largest request head (request line and headers); larger ones get 431"),
    Flag("max-headers", 100, "Most headers in one request; more get 431", int),
    Flag(
        "header-timeout",
        10.0,
        "Seconds a request's line and headers may take to arrive, from its first byte (a new connection: from its start); then 408",
        float,
    ),
    Flag("body-timeout", 30.0, "Seconds a request's body may take to arrive after its headers; then 408", float),
    Flag("keep-alive-timeout", 30.0, "Seconds an idle kept-alive connection stays open between requests", float),
    Flag("max-connections", 2048, "HTTP connections open at once; more are answered 503 and closed", int),
    Flag(
        "cors-allow-origins",
        None,
        "Origins allowed to call the API from a browser, comma-separated (* for any); CORS is off by default",
    ),
    Flag(
        "allow-request-chat-template",
        False,
        "Let requests bring their own `chat_template` (rendered in the sandbox); refused by default",
        bool,
    ),
    Flag(
        "share-prefix-cache",
        False,
        "Let every API key's requests share cached prompt blocks; by default each key's are its own (salted), "
        "so one tenant cannot learn another's prompts from timing",
        bool,
    ),
    Flag(
        "strict-fields",
        False,
        "Refuse request fields no API defines with a 400 naming them; by default they are logged once and counted",
        bool,
    ),
    Flag("ui", True, "Serve the playground (/) and operator page (/dashboard)", bool),
    Flag("max-concurrent-requests", 256, "Requests in flight at the workers; more wait in a bounded queue", int),
    Flag("max-waiting-requests", 256, "Requests queued for a slot; past that, 429 with Retry-After at once", int),
    Flag("request-timeout", 600.0, "Seconds a request may take before it is aborted with 504", float),
    Flag(
        "shutdown-grace",
        30.0,
        "Seconds in-flight requests get to finish after SIGTERM; new connections are refused",
        float,
    ),
    Flag(
        "websocket-idle-timeout",
        600.0,
        "Seconds a Responses WebSocket may sit with no response in flight and no event from its client; then it is closed",
        float,
    ),
    Flag(
        "websocket-max-age",
        3600.0,
        "Seconds a Responses WebSocket may stay open (OpenAI's limit is 60 minutes); then an error event and a close",
        float,
    ),
    Flag(
        "hung-timeout",
        60.0,
        "Seconds a worker holding requests may go without producing anything before it counts as hung",
        float,
    ),
    Flag(
        "prefix-affinity-slack",
        2048,
        "Route a request to the worker that last saw its prefix unless that worker has this many more outstanding tokens than the least-loaded one; -1 turns affinity off",
        int,
    ),
    Flag(
        "curve-server-secret-key",
        None,
        "CURVE: the gateway's secret key file (from `llmpool keys`); encrypts worker traffic",
    ),
    Flag("curve-authorized-keys", None, "CURVE: folder of worker public key files allowed to connect"),
    Flag("max-retries", 2, "Times a request is moved to another worker after its worker died, before it fails", int),
    Flag(
        "tool-call-parser",
        "hermes",
        'How tool calls are read from the model\'s own output (tool_choice auto): hermes, i.e. <tool_call>{"name": ..., "arguments": ...}</tool_call>',
    ),
    Flag(
        "reasoning-parser",
        "auto",
        "How a reasoning model's thinking is split from its answer: auto (the <think>-style markers its chat template names), "
        "deepseek_r1, qwen3, or none",
    ),
    Flag("tokenizer-threads", 2, "Threads that render templates and tokenize off the event loop", int),
    Flag(
        "otlp-endpoint",
        None,
        "OpenTelemetry: OTLP/HTTP endpoint to export traces to (e.g. http://collector:4318); tracing is off without it",
    ),
    Flag("otlp-service-name", "llmpool-gateway", "OpenTelemetry: the service.name of this gateway's spans"),
    Flag(
        "state-url",
        None,
        "Where stored responses, conversations and usage live: sqlite:///PATH (sqlite:////abs/path) or postgresql://USER:PASS@HOST/DB, "
        "shared by every gateway that names it; default: sqlite:///<cache dir>/state.db",
    ),
    Flag(
        "state-max-age",
        "30d",
        "Stored responses and conversations older than this are purged (90s, 15m, 12h, 30d)",
        parse_duration,
    ),
    Flag("state-max-bytes", "8GiB", "The store's size bound: the oldest responses are purged beyond it", parse_size),
    Flag(
        "state-max-response-bytes",
        "1MiB",
        "Largest stored response (its input items, instructions, tools, metadata); larger ones are 400s",
        parse_size,
    ),
    Flag(
        "state-max-key-bytes",
        "256MiB",
        "Bytes one API key may keep stored: its oldest responses go beyond it",
        parse_size,
    ),
    Flag("state-purge-interval", 60.0, "Seconds between background purges of expired and excess responses", float),
    Flag(
        "state-log-interval",
        0.5,
        "Seconds a logged stream's events gather before one commit writes them (a row per response): "
        "fewer rows cost the token path less; a gateway that dies loses at most this much of its log, "
        "which the gateway taking its streams over regenerates",
        float,
    ),
    Flag(
        "admin-key",
        None,
        "Admin key(s), comma-separated: GET /v1/usage and /admin/keys want one (closed without it); "
        "with it, managed API keys are on and the API wants a managed key or an --api-key one",
    ),
    Flag(
        "scheduling-policy",
        "fcfs",
        "fcfs: requests in arrival order (a nonzero `priority` is a 400); priority: by each request's `priority` "
        "(lower first), in admission and in the workers, preempting the least urgent first. Batch work is always last",
    ),
    Flag(
        "batch-max-inflight",
        16,
        "Batch requests this gateway runs at once, at most, and only on idle capacity (0: it runs none)",
        int,
    ),
    Flag("max-file-size", "200MiB", "Largest file uploaded to /v1/files (a batch's input)"),
    # Images for image-text models (gateway/generate/media.py): data: URIs always; http(s) to public addresses only.
    Flag("allowed-media-domains", None, "Hosts image URLs may name, comma-separated (default: any public host)"),
    Flag("allowed-local-media-path", None, "A directory whose files image URLs may name as file://; off by default"),
    Flag("max-images-per-request", 8, "Most images one request may hold", int),
    Flag("max-image-bytes", "20MiB", "Largest image (fetched, or in a data: URI); larger ones get 413", parse_size),
    Flag("media-fetch-timeout", 10.0, "Seconds an image fetch may wait on each read", float),
    Flag(
        "allow-private-media-addresses",
        False,
        "Fetch images from private and loopback addresses too (tests and closed networks only)",
        bool,
    ),
    Flag(
        "files-url",
        None,
        "Where the bytes of /v1/files files (batch inputs, outputs) live: file:///DIR or s3://BUCKET/PREFIX "
        "(credentials and region from the standard AWS variables); every gateway of a fleet names the same one; "
        "default: in the state database",
    ),
    Flag(
        "files-s3-endpoint",
        None,
        "The S3-compatible server of an s3:// --files-url (e.g. http://minio:9000); default: AWS_ENDPOINT_URL, else AWS",
    ),
]


@dataclass(slots=True)
class GatewayConfig(SharedConfig):
    """Parsed gateway settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    zmq_bind: str = "tcp://127.0.0.1:5555"
    api_key: str | None = None
    ui: bool = True
    max_body_size: str = "4MiB"
    max_header_size: str = "32KiB"
    max_headers: int = 100
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 30.0
    max_connections: int = 2048
    cors_allow_origins: str | None = None
    allow_request_chat_template: bool = False
    strict_fields: bool = False
    share_prefix_cache: bool = False
    max_retries: int = 2
    shutdown_grace: float = 30.0
    websocket_idle_timeout: float = 600.0
    websocket_max_age: float = 3600.0
    hung_timeout: float = 60.0
    prefix_affinity_slack: int = 2048
    curve_server_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    max_concurrent_requests: int = 256
    max_waiting_requests: int = 256
    request_timeout: float = 600.0
    tokenizer_threads: int = 2
    tool_call_parser: str = "hermes"
    reasoning_parser: str = "auto"
    otlp_endpoint: str | None = None
    otlp_service_name: str = "llmpool-gateway"
    state_url: str | None = None
    state_max_age: float = 30 * 86400.0
    state_max_bytes: int = 8 * 2**30
    state_max_response_bytes: int = 2**20
    state_max_key_bytes: int = 256 * 2**20
    state_purge_interval: float = 60.0
    state_log_interval: float = 0.5
    admin_key: str | None = None
    scheduling_policy: str = "fcfs"
    batch_max_inflight: int = 16
    max_file_size: str = "200MiB"
    allowed_media_domains: str | None = None
    allowed_local_media_path: str | None = None
    max_images_per_request: int = 8
    max_image_bytes: int = 20 << 20
    media_fetch_timeout: float = 10.0
    allow_private_media_addresses: bool = False
    files_url: str | None = None
    files_s3_endpoint: str | None = None


ALL_GATEWAY_FLAGS = [*SHARED_FLAGS, *GATEWAY_FLAGS]
