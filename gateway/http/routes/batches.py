"""OpenAI's Batch API (``client.batches.create/retrieve/list/cancel``): a file of requests run at the
lowest priority on the pool's idle capacity (gateway/batch/runner.py), results in an output file
(``client.files.content(batch.output_file_id)``). Scoped to the caller's key."""

from __future__ import annotations

from typing import TypeAlias

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody

from gateway.batch.runner import BatchRunner
from gateway.errors import InvalidRequest, not_stored
from gateway.http.auth import caller_owner
from gateway.http.routes.common import BATCH, documented, json_response
from gateway.http.routes.files import check_limit, list_page
from gateway.http.routes.response_items import ItemList
from gateway.state.batches import ENDPOINTS, WINDOWS, Batches
from gateway.state.files import Files
from gateway.state.limits import check_metadata


class BatchBody(msgspec.Struct, kw_only=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict | None = None


class BatchObject(msgspec.Struct):
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    request_counts: dict
    object: str = "batch"


# The batches as a route takes them (Litestar's ``batches`` dependency, gateway/http/app.py).
BatchStore: TypeAlias = NamedDependency[Batches]


class BatchesController(Controller):
    path = "/v1/batches"

    @post("/", status_code=200, responses=documented(BatchObject, "the batch, validating"))
    async def create(
        self,
        request: Request,
        data: JSONBody[BatchBody],
        files: NamedDependency[Files],
        batches: BatchStore,
        batch_runner: NamedDependency[BatchRunner],
    ) -> Response:
        if data.endpoint not in ENDPOINTS:
            raise InvalidRequest(
                f"`endpoint` must be one of {', '.join(ENDPOINTS)}; got {data.endpoint!r}", param="endpoint"
            )
        if data.completion_window not in WINDOWS:
            raise InvalidRequest(
                f"`completion_window` must be {', '.join(WINDOWS)}; got {data.completion_window!r}",
                param="completion_window",
            )
        owner = caller_owner(request)
        found = await files.get(data.input_file_id, owner)
        if found is None:
            raise not_stored("file", data.input_file_id, "input_file_id")
        if found["purpose"] != "batch":
            raise InvalidRequest(
                f"the input file's purpose is {found['purpose']!r}; a batch wants a file uploaded with `purpose: batch`",
                param="input_file_id",
            )
        metadata = check_metadata(data.metadata) if data.metadata is not None else None
        made = await batches.create(owner, data.input_file_id, data.endpoint, data.completion_window, metadata)
        batch_runner.wake()
        return json_response(made)

    @get("/", responses=documented(ItemList, "the caller's batches, newest first"))
    async def index(
        self, request: Request, batches: BatchStore, limit: FromQuery[int] = 20, after: FromQuery[str | None] = None
    ) -> Response:
        check_limit(limit)
        data, more = await batches.list(caller_owner(request), limit, after)
        return json_response(list_page(data, more))

    @get("/{batch_id:str}", responses=documented(BatchObject, "the batch"))
    async def retrieve(self, request: Request, batch_id: FromPath[str], batches: BatchStore) -> Response:
        found = BATCH.found(await batches.get(batch_id, caller_owner(request)), batch_id)
        return json_response(found)

    @post("/{batch_id:str}/cancel", status_code=200, responses=documented(BatchObject, "the batch, cancelling"))
    async def cancel(
        self,
        request: Request,
        batch_id: FromPath[str],
        batches: BatchStore,
        batch_runner: NamedDependency[BatchRunner],
    ) -> Response:
        found = BATCH.found(await batches.cancel(batch_id, caller_owner(request)), batch_id)
        if found["status"] not in ("cancelling", "cancelled"):
            raise InvalidRequest(f"the batch is {found['status']}: it can no longer be cancelled", param="batch_id")
        batch_runner.wake()
        return json_response(found)
