"""GET /v1/usage: tokens per API key (hashed), model and day, for the admin key only (--admin-key).

Query: ``start`` and ``end`` days (YYYY-MM-DD, UTC; default: the last 30 days), and optionally
``key`` (a hashed key as the report and the Prometheus ``key`` label show it, or a managed key's id)
and ``model``. A managed key's rows also name it (``key_id``, ``key_name``).
Each gateway adds its counts to the store every heartbeat; this gateway's own are flushed first.
``batch`` (a batch id, or ``*`` for all) answers per batch instead: its key, model, status, requests
run and tokens, counted as each request's line is written (a batch's tokens are also in its key's
daily rows above).
"""

from __future__ import annotations

import time

import msgspec
from litestar import Response, get
from litestar.di import NamedDependency
from litestar.params import FromQuery

from gateway.errors import InvalidRequest
from gateway.http.routes.common import documented, json_response
from gateway.policy.quotas import Quotas
from gateway.state.batches import Batches
from gateway.state.records import key_label
from gateway.state.service import StateService
from gateway.state.usage import day_of


class UsageReport(msgspec.Struct):
    data: list[dict]
    start: str
    end: str
    object: str = "list"


@get("/v1/usage", responses=documented(UsageReport, "usage per key, model and day"))
async def usage(
    stored: NamedDependency[StateService],
    quotas: NamedDependency[Quotas],
    batches: NamedDependency[Batches],
    start: FromQuery[str | None] = None,
    end: FromQuery[str | None] = None,
    key: FromQuery[str | None] = None,
    model: FromQuery[str | None] = None,
    batch: FromQuery[str | None] = None,
) -> Response:
    now = time.time()
    start = start or day_of(now - 29 * 86400)
    end = end or day_of(now)
    for name, value in (("start", start), ("end", end)):
        try:
            time.strptime(value, "%Y-%m-%d")
        except ValueError:
            raise InvalidRequest(f"`{name}` must be a day as YYYY-MM-DD; got {value!r}", param=name) from None
    if batch is not None:
        rows = await batches.usage(None if batch == "*" else batch)
        data = [{**row, "key": key_label(row.pop("owner"))} for row in rows]
        return json_response(UsageReport([r for r in data if key in (None, r["key"])], start, end))
    state = stored
    rows = await state.usage.report(state.store.db, start, end, None, model)
    managed = {key_label(k.owner): k for k in await quotas.store.list()}
    for row in rows:
        if row["key"] in managed:
            row["key_id"], row["key_name"] = managed[row["key"]].id, managed[row["key"]].name
    if key is not None:
        rows = [row for row in rows if key in (row["key"], row.get("key_id"))]
    return json_response(UsageReport(rows, start, end))
