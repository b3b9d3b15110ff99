"""/admin/keys: managed API keys (gateway/state/keys.py), for the admin key only (--admin-key).

``POST /admin/keys`` makes one and answers its secret, once; ``GET /admin/keys`` lists them with
this month's usage; ``GET``/``POST`` (or ``PATCH``)/``DELETE /admin/keys/{id}`` read, change and
revoke one. A revoked key stays listed (its usage is still its own) and works nowhere after the
key cache's lifetime (the heartbeat interval; at once on the gateway that revoked it).
"""

from __future__ import annotations

import msgspec
from litestar import Controller, Response, delete, get, patch, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from gateway.errors import InvalidRequest, NotFound
from gateway.http.routes.common import documented, json_response
from gateway.policy.quotas import Quotas
from gateway.state.keys import LIMITS, KeyRecord, KeyStore
from gateway.state.service import StateService


class KeySettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A key's settings; on update, only those given change (null lifts a limit)."""

    name: str | msgspec.UnsetType = msgspec.UNSET
    rpm: int | None | msgspec.UnsetType = msgspec.UNSET
    tpm: int | None | msgspec.UnsetType = msgspec.UNSET
    max_concurrent: int | None | msgspec.UnsetType = msgspec.UNSET
    monthly_tokens: int | None | msgspec.UnsetType = msgspec.UNSET
    models: list[str] | None | msgspec.UnsetType = msgspec.UNSET
    default_priority: int | msgspec.UnsetType = msgspec.UNSET

    def given(self) -> dict[str, object]:
        """The settings given, checked: limits are positive, a name is 1-64 characters."""
        out = {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not msgspec.UNSET}
        for limit in LIMITS:
            if out.get(limit) is not None and out[limit] < 1:
                raise InvalidRequest(f"`{limit}` must be at least 1, or null for no limit", param=limit)
        if "name" in out and not 0 < len(out["name"]) <= 64:
            raise InvalidRequest("`name` must be 1 to 64 characters", param="name")
        return out


class KeyList(msgspec.Struct):
    data: list[dict]
    object: str = "list"


async def _found(keys: KeyStore, key_id: str) -> KeyRecord:
    key = await keys.get(key_id)
    if key is None:
        raise NotFound(f"No API key with id {key_id!r}", param="key_id", code="not_found")
    return key


async def _with_usage(state: StateService, keys: list[KeyRecord]) -> list[dict]:
    """Each key's view with its usage this month (UTC), fleet-wide."""
    totals = await state.usage.month_totals(state.store.db)
    return [{**key.view(), "usage_this_month": totals.get(key.owner, {})} for key in keys]


class KeysController(Controller):
    path = "/admin/keys"

    @post("/", status_code=201, responses=documented(None, "the key, with its secret (shown only now)"))
    async def create(self, data: JSONBody[KeySettings], quotas: NamedDependency[Quotas]) -> Response:
        settings = data.given()
        if "name" not in settings:
            raise InvalidRequest("`name` is required", param="name")
        key = await quotas.store.create(**settings)
        response = json_response(key.view())
        response.status_code = 201
        return response

    @get("/", responses=documented(KeyList, "every key, revoked ones too, with this month's usage"))
    async def list_keys(self, quotas: NamedDependency[Quotas], stored: NamedDependency[StateService]) -> Response:
        return json_response(KeyList(await _with_usage(stored, await quotas.store.list())))

    @get("/{key_id:str}", responses=documented(None, "the key (never its secret)"))
    async def retrieve(
        self, key_id: FromPath[str], quotas: NamedDependency[Quotas], stored: NamedDependency[StateService]
    ) -> Response:
        return json_response((await _with_usage(stored, [await _found(quotas.store, key_id)]))[0])

    @post("/{key_id:str}", status_code=200, responses=documented(None, "the key as changed"))
    async def update(
        self, key_id: FromPath[str], data: JSONBody[KeySettings], quotas: NamedDependency[Quotas]
    ) -> Response:
        return await self._update(quotas, key_id, data)

    @patch("/{key_id:str}", status_code=200, responses=documented(None, "the key as changed"))
    async def patch(
        self, key_id: FromPath[str], data: JSONBody[KeySettings], quotas: NamedDependency[Quotas]
    ) -> Response:
        return await self._update(quotas, key_id, data)

    async def _update(self, quotas: Quotas, key_id: str, data: KeySettings) -> Response:
        key = await _found(quotas.store, key_id)
        quotas.cache.forget(key)
        return json_response((await quotas.store.update(key_id, **data.given())).view())

    @delete("/{key_id:str}", status_code=200, responses=documented(None, "the key, revoked"))
    async def revoke(self, key_id: FromPath[str], quotas: NamedDependency[Quotas]) -> Response:
        key = await _found(quotas.store, key_id)
        quotas.cache.forget(key)
        return json_response({**(await quotas.store.revoke(key_id)).view(), "deleted": True})
