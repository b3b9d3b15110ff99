"""create_app(config) -> Litestar: the routes behind their guards, the services they take as
dependencies, and the lifespan that starts those services in order and stops them in reverse."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from litestar import Litestar, Router
from litestar.config.cors import CORSConfig
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.types import ASGIApp, Receive, Scope, Send

from common.config import parse_size
from gateway.batch.runner import BatchRunner
from gateway.config import GatewayConfig, default_state_url
from gateway.errors import EXCEPTION_HANDLERS
from gateway.fleet.worker_client import WorkerClient
from gateway.generate.lanes import Lanes
from gateway.generate.media import MediaRules
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.reasoning import PARSERS as REASONING_PARSERS
from gateway.generate.tools import PARSERS
from gateway.http.auth import admin_guard, api_key_guard, caller_of, rate_headers
from gateway.http.fields import FieldWatch
from gateway.http.request_body import GatewayRequest
from gateway.http.routes.adapters import LoraController
from gateway.http.routes.admin_keys import KeysController
from gateway.http.routes.batches import BatchesController
from gateway.http.routes.chat import ChatController
from gateway.http.routes.completions import CompletionsController
from gateway.http.routes.conversations import ConversationsController
from gateway.http.routes.decisions import DecisionsController
from gateway.http.routes.embeddings import EmbeddingsController
from gateway.http.routes.files import FilesController
from gateway.http.routes.health import health, metrics, ready, workers
from gateway.http.routes.messages import MessagesController
from gateway.http.routes.models import ModelsController
from gateway.http.routes.rerank import rerank, score
from gateway.http.routes.response_items import ResponseItemsController
from gateway.http.routes.responses import ResponsesController, take_over
from gateway.http.routes.responses_ws import SocketDrain, SocketLimits, responses_socket
from gateway.http.routes.tokenize import TokenizeController
from gateway.http.routes.tokens_io import TokensController, abort_beat
from gateway.http.routes.ui import UI_ROUTES
from gateway.http.routes.usage import usage
from gateway.ops import tracing
from gateway.ops.metrics import Metrics, http_metrics_middleware
from gateway.policy.admission import Admission
from gateway.policy.auth import parse_keys
from gateway.policy.priority import POLICIES
from gateway.policy.quotas import Quotas
from gateway.policy.rules import Rules
from gateway.state.adapters import LoraTable
from gateway.state.batches import Batches
from gateway.state.file_store import check_files_url, open_file_store
from gateway.state.files import Files
from gateway.state.keys import KeyStore
from gateway.state.service import StateService
from gateway.state.store import Limits
from gateway.state.usage import UsageMeter
from gateway.state.windows import Windows

log = logging.getLogger(__name__)


def provide_models(state: State) -> ModelRegistry:
    return state.models


def provide_stored(state: State) -> StateService:
    return state.state


def provide_files(state: State) -> Files | None:
    """The Files API's service where the app has one (an app built for in-process tests may not)."""
    return state.get("files")


def provide_batches(state: State) -> Batches:
    return state.batches


def provide_batch_runner(state: State) -> BatchRunner | None:
    return state.get("batch_runner")


def provide_quotas(state: State) -> Quotas:
    return state.quotas


# The services the routes take as parameters (Litestar's dependency injection), instead of reading
# the application's state: the models, the caller of the request (gateway/policy/caller.py), the
# state store, files and batches (and the runner to wake), managed keys' quotas. The lifespan
# below puts them on the state; tests/gateway/conftest.py provides its own models and store.
DEPENDENCIES = {
    "models": Provide(provide_models, sync_to_thread=False),
    "caller": Provide(caller_of, sync_to_thread=False),
    "stored": Provide(provide_stored, sync_to_thread=False),
    "files": Provide(provide_files, sync_to_thread=False),
    "batches": Provide(provide_batches, sync_to_thread=False),
    "batch_runner": Provide(provide_batch_runner, sync_to_thread=False),
    "quotas": Provide(provide_quotas, sync_to_thread=False),
}


def openapi_config(guards: list) -> OpenAPIConfig:
    """The OpenAPI document as JSON at /schema/openapi.json (and /schema), behind the API key when
    there is one; no rendered pages, whose scripts came from a CDN."""
    router = Router(path="/schema", route_handlers=[], include_in_schema=False, guards=guards)
    return OpenAPIConfig(
        title="llmpool",
        version="1",
        render_plugins=[JsonRenderPlugin(path=["/openapi.json", "/"])],
        openapi_router=router,
    )


def _import_tokenizers() -> None:
    """Import what loading the first worker's tokenizer needs while the workers start: 2-3 s of
    imports that otherwise run after the first worker registers (``import transformers`` alone is lazy
    and takes under half of it; ``AutoTokenizer`` pulls in the rest)."""
    importlib.import_module("transformers").AutoTokenizer  # the attribute access is the import


def head_as_get(handler: ASGIApp) -> ASGIApp:
    """HEAD is answered wherever GET is (load balancers probe with HEAD; Litestar routes only the
    methods a handler names, so HEAD /health was a 405): the application sees a GET, and the HTTP
    server, which knows the request was a HEAD, sends the headers without the body."""

    async def handle(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        await handler(scope, receive, send)

    return handle


def check_choices(config: GatewayConfig) -> None:
    """Flags that name one of a few choices, refused at start when they name another."""
    for flag, value, choices in (
        ("--tool-call-parser", config.tool_call_parser, PARSERS),
        ("--reasoning-parser", config.reasoning_parser, REASONING_PARSERS),
        ("--scheduling-policy", config.scheduling_policy, POLICIES),
    ):
        if value not in choices:
            raise ValueError(f"{flag} must be one of {', '.join(choices)}; got {value!r}")
    check_files_url(config.files_url)


def start_fleet(config: GatewayConfig, rules: Rules) -> tuple[WorkerClient, ModelRegistry]:
    """The worker client (the ROUTER socket, not yet bound) and the models it will learn."""
    client = WorkerClient(
        config.zmq_bind,
        config.heartbeat_interval,
        config.heartbeat_liveness,
        config.max_retries,
        config.hung_timeout,
        config.prefix_affinity_slack if config.prefix_affinity_slack >= 0 else None,
        config.curve_server_secret_key,
        config.curve_authorized_keys,
    )
    admission = Admission(config.max_concurrent_requests, config.max_waiting_requests, stall_s=config.hung_timeout)
    models = ModelRegistry(
        client,
        Metrics(client.snapshot, admission),
        admission,
        Lanes(config.tokenizer_threads),
        config.request_timeout,
        config.reasoning_parser,
        rules,
    )
    client.learn_model = models.learn
    models.media = MediaRules(
        config.max_image_bytes,
        config.media_fetch_timeout,
        max_images=config.max_images_per_request,
        allowed_domains=tuple(d.strip().lower() for d in (config.allowed_media_domains or "").split(",") if d.strip()),
        local_root=config.allowed_local_media_path,
        allow_private=config.allow_private_media_addresses,
    )
    return client, models


async def open_state(app: Litestar, config: GatewayConfig, client: WorkerClient, models: ModelRegistry) -> StateService:
    """The state store and what lives on it: usage, managed keys' quotas, runtime LoRA adapters,
    files and batches; its heartbeat started (which also takes over dead gateways' responses)."""
    rules = models.rules
    app.state.usage = rules.usage = UsageMeter(models.metrics.registry)
    limits = Limits(
        config.state_max_age,
        config.state_max_bytes,
        config.state_max_response_bytes,
        config.state_max_key_bytes,
        config.state_log_interval,
    )
    heartbeat = config.heartbeat_interval
    lease_s = heartbeat * config.heartbeat_liveness
    url = config.state_url or default_state_url()
    if config.state_url is None:  # two unrelated `llmpool serve` on one machine share it: say so
        log.info(
            "state (keys, stored responses, LoRA adapters) in %s, the default: shared with every gateway on this "
            "machine that uses the same cache dir; --state-url (LLMPOOL_STATE_URL) keeps this one apart",
            url,
        )
    state = await StateService.open(url, limits, rules.usage, heartbeat, lease_s, config.state_purge_interval)
    app.state.state = state
    db = state.store.db
    windows = Windows(db, state.store.gateway_id, lease_s, heartbeat)
    app.state.quotas = rules.quotas = Quotas(KeyStore(db), windows, models.admission, rules.usage, heartbeat)
    state.hooks.append(rules.quotas.sync)
    client.loras.table = LoraTable(db)  # runtime LoRA adapters are the fleet's (gateway/fleet/lora.py)
    state.hooks.append(partial(client.loras.sync, client.models))
    state.hooks.append(partial(abort_beat, state.aborts))  # /abort_requests made on another gateway
    state.start(lambda response_id, gateway: take_over(state, models, response_id, gateway))
    return state


async def open_batches(app: Litestar, config: GatewayConfig, client: WorkerClient, file_store, state: StateService):
    """Files and batches on the state store, and the runner that fills idle capacity with them."""
    app.state.files = Files(state.store.db, file_store)
    app.state.batches = Batches(state.store.db, app.state.files, state.store.gateway_id)
    return BatchRunner(
        app,
        app.state.batches,
        app.state.files,
        app.state.models.admission,
        lambda: client.dispatch.roster.workers.values(),
        config.heartbeat_interval,
        config.heartbeat_interval * config.heartbeat_liveness,
        config.batch_max_inflight,
    )


def lifespan_of(config: GatewayConfig, keys: frozenset[str]):
    """Start the services in order (files' bucket, tracing, the fleet, the state store, batches),
    then the socket and the runner; stop them in the reverse order."""

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        file_store = await open_file_store(config.files_url, config.files_s3_endpoint)  # a bad bucket: refused now
        tracing.setup(config.otlp_endpoint, config.otlp_service_name)
        rules = Rules(
            scheduling_policy=config.scheduling_policy,
            allow_request_chat_template=config.allow_request_chat_template,
            share_prefix_cache=config.share_prefix_cache,
        )
        client, models = start_fleet(config, rules)
        app.state.api_keys = keys
        app.state.models = models
        app.state.fields = FieldWatch(config.strict_fields, models.metrics.unknown_fields)
        state = await open_state(app, config, client, models)
        runner = app.state.batch_runner = await open_batches(app, config, client, file_store, state)
        await client.start()
        runner.start()
        threading.Thread(target=_import_tokenizers, daemon=True).start()
        log.info(
            "gateway on http://%s:%d; models come with the workers that register on %s",
            config.host,
            config.port,
            config.zmq_bind,
        )
        try:
            yield
        finally:
            await runner.close()
            await state.close()
            models.close()
            await client.stop()
            tracing.shutdown()

    return lifespan


def routers(config: GatewayConfig, keys: frozenset[str], admin_keys: frozenset[str]) -> list[Router]:
    """The API behind the API key (when there is one) and the operator's routes behind the admin key."""
    guards = [api_key_guard(keys, managed=bool(admin_keys))] if keys or admin_keys else []
    files = type("FilesController", (FilesController,), {"request_max_body_size": parse_size(config.max_file_size)})
    api = Router(
        path="/",
        route_handlers=[
            ChatController,
            CompletionsController,
            ResponsesController,
            responses_socket,
            ResponseItemsController,
            ConversationsController,
            files,
            BatchesController,
            MessagesController,
            ModelsController,
            TokenizeController,
            TokensController,
            DecisionsController,
            EmbeddingsController,
            LoraController,
            rerank,
            score,
            ready,
            workers,
            metrics,
        ],
        guards=guards,
    )
    admin = Router(path="/", route_handlers=[usage, KeysController], guards=[admin_guard(admin_keys)])
    return [api, admin]


def create_app(config: GatewayConfig) -> Litestar:
    check_choices(config)
    keys, admin_keys = parse_keys(config.api_key), parse_keys(config.admin_key)
    guards = [api_key_guard(keys, managed=bool(admin_keys))] if keys or admin_keys else []
    origins = [o.strip() for o in (config.cors_allow_origins or "").split(",") if o.strip()]
    app = Litestar(
        route_handlers=[*routers(config, keys, admin_keys), health, *(UI_ROUTES if config.ui else [])],
        request_max_body_size=parse_size(config.max_body_size),
        cors_config=CORSConfig(
            allow_origins=origins,
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version", "anthropic-beta"],
        )
        if origins
        else None,
        dependencies=DEPENDENCIES,
        exception_handlers=EXCEPTION_HANDLERS,
        request_class=GatewayRequest,
        middleware=[
            tracing.middleware,
            rate_headers,
            http_metrics_middleware(lambda: getattr(getattr(app.state, "models", None), "metrics", None)),
        ],
        lifespan=[lifespan_of(config, keys)],
        logging_config=None,  # common.logs configures logging, the same way in every process
        openapi_config=openapi_config(guards),
    )
    app.state.websocket_limits = SocketLimits(config.websocket_idle_timeout, config.websocket_max_age)
    app.state.websocket_drain = SocketDrain()
    app.asgi_handler = head_as_get(app.asgi_handler)  # routing happens inside it: HEAD must become GET first
    return app
