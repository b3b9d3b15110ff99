"""The gateway in process for route and core tests: the real routes, checks and templates over a
fake worker client (``FakeFleet``: no worker processes, no sockets), through Litestar's test client."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from litestar import Litestar
from litestar.di import Provide
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry

from common.protocol import FinishReason, NewRequest, RequestOutput
from gateway.errors import EXCEPTION_HANDLERS
from gateway.fleet.workers import UNTRACED, RequestStream, Trace
from gateway.generate.lanes import Lanes
from gateway.generate.model_registry import ModelRegistry
from gateway.generate.served_model import ServedModel
from gateway.generate.templates import ChatTemplate
from gateway.http.app import DEPENDENCIES
from gateway.http.request_body import GatewayRequest
from gateway.http.routes.chat import ChatController
from gateway.http.routes.completions import CompletionsController
from gateway.http.routes.messages import MessagesController
from gateway.http.routes.responses import ResponsesController
from gateway.ops.metrics import Metrics
from gateway.policy.admission import Admission
from gateway.state.service import StateService
from gateway.state.store import Limits
from gateway.state.usage import UsageMeter

REPLY = " Hello there, friend"


class FakeFleet:
    """The worker client without workers: each request is answered at once with REPLY's tokens
    (as many as its budget takes), and kept in ``submitted`` for the test to read."""

    def __init__(self, tokenizer) -> None:
        self.models = {"m": SimpleNamespace(workers={})}
        self.reply = tokenizer.encode(REPLY, add_special_tokens=False)
        self.submitted: list[NewRequest] = []

    def limits(self, model: str) -> tuple[int, int]:
        return 2048, 1 << 20  # context length, KV capacity in tokens

    def available(self, model: str) -> list:
        return [object()]

    def submit(self, request: NewRequest, model: str, trace: Trace = UNTRACED, delivered=None) -> RequestStream:
        self.submitted.append(request)
        stream = RequestStream(request, model, trace)
        ids = self.reply[: request.max_new_tokens]
        finish = FinishReason.LENGTH if len(ids) < len(self.reply) else FinishReason.STOP
        stream.deliver(RequestOutput(request.request_id, ids, finish, len(request.prompt_token_ids), len(ids)))
        stream.finished = True
        return stream

    def abort(self, request_id: str) -> None:
        pass

    def snapshot(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def fake_fleet(tokenizer):
    return FakeFleet(tokenizer)


@pytest.fixture(scope="module")
def inproc(tokenizer, fake_fleet, tmp_path_factory):
    """Litestar's test client on the four dialects' routes over ``fake_fleet``, with a state store
    in a SQLite file (streams are logged there, gateway/http/routes/stream_runs.py)."""
    fleet = fake_fleet
    admission = Admission(8, 8)
    lanes = Lanes(1)
    registry = ModelRegistry(fleet, Metrics(fleet.snapshot, admission), admission, lanes, 30.0)
    template = ChatTemplate(
        tokenizer.chat_template, {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token}
    )
    registry.served_models["m"] = ServedModel(
        fleet, tokenizer, template, "m", lanes, registry.metrics, admission, 30.0, rules=registry.rules
    )
    stored: list[StateService] = []
    url = f"sqlite:///{tmp_path_factory.mktemp('inproc')}/state.db"

    async def open_store() -> None:
        # each client that starts the app (test_walk starts its own) gets a store in its own loop
        stored.append(await StateService.open(url, Limits(), UsageMeter(CollectorRegistry()), 1.0, 3.0, 60.0))

    async def close_store() -> None:
        await stored.pop().close()

    app = Litestar(
        on_startup=[open_store],
        on_shutdown=[close_store],
        route_handlers=[ChatController, CompletionsController, ResponsesController, MessagesController],
        dependencies={
            **DEPENDENCIES,
            "models": Provide(lambda: registry, sync_to_thread=False),
            "stored": Provide(lambda: stored[-1], sync_to_thread=False),
        },
        exception_handlers=EXCEPTION_HANDLERS,
        request_class=GatewayRequest,
    )
    with TestClient(app) as test_client:
        yield test_client
    lanes.close()
