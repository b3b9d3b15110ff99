"""OpenAI's Files API, as far as batches need it (``client.files.create/list/retrieve/content/delete``):
a batch's input (``purpose: batch``), the output and error files a batch makes (``batch_output``),
scoped to the caller's key like everything stored (another key's is a 404). Bytes live in the state
database, a directory or a bucket (``--files-url``; gateway/state/files.py says why); an upload is at
most ``--max-file-size``."""

from __future__ import annotations

from typing import Literal

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from gateway.errors import GatewayError, InvalidRequest
from gateway.http.auth import caller_owner
from gateway.http.routes.common import FILE, documented, json_response
from gateway.http.routes.response_items import ItemList
from gateway.state.file_store import ContentUnavailable
from gateway.state.files import Files

UPLOAD_PURPOSES = ("batch", "user_data")


class FileObject(msgspec.Struct):
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    object: str = "file"


class DeletedFile(msgspec.Struct):
    id: str
    object: str = "file"
    deleted: bool = True


def list_page(data: list[dict], has_more: bool) -> ItemList:
    return ItemList(data, data[0]["id"] if data else None, data[-1]["id"] if data else None, has_more)


def check_limit(limit: int, most: int = 100) -> None:
    if not 1 <= limit <= most:
        raise InvalidRequest(f"`limit` must be between 1 and {most}; got {limit}", param="limit")


class FilesController(Controller):
    path = "/v1/files"

    @post("/", status_code=200, responses=documented(FileObject, "the file, stored"))
    async def upload(self, request: Request, files: NamedDependency[Files]) -> Response:
        form = await request.form()
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise InvalidRequest("`file` must be a file, sent as multipart/form-data", param="file")
        if purpose not in UPLOAD_PURPOSES:
            raise InvalidRequest(
                f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}; got {purpose!r}", param="purpose"
            )
        content = await upload.read()
        made = await files.create(caller_owner(request), purpose, upload.filename or "upload", content)
        return json_response(made)

    @get("/", responses=documented(ItemList, "the caller's files, newest first unless `order=asc`"))
    async def index(
        self,
        request: Request,
        files: NamedDependency[Files],
        purpose: FromQuery[str | None] = None,
        limit: FromQuery[int] = 100,
        after: FromQuery[str | None] = None,
        order: FromQuery[Literal["asc", "desc"]] = "desc",
    ) -> Response:
        check_limit(limit, 10_000)
        data, more = await files.list(caller_owner(request), purpose, limit, after, order == "asc")
        return json_response(list_page(data, more))

    @get("/{file_id:str}", responses=documented(FileObject, "the file"))
    async def retrieve(self, request: Request, file_id: FromPath[str], files: NamedDependency[Files]) -> Response:
        found = FILE.found(await files.get(file_id, caller_owner(request)), file_id)
        return json_response(found)

    @get("/{file_id:str}/content", responses=documented(None, "the file's bytes"))
    async def content(self, request: Request, file_id: FromPath[str], files: NamedDependency[Files]) -> Response:
        try:
            found = await files.content(file_id, caller_owner(request))
        except ContentUnavailable as exc:
            raise GatewayError(str(exc), param="file_id", code="file_content_unavailable") from exc
        return Response(content=FILE.found(found, file_id), media_type="application/octet-stream")

    @delete("/{file_id:str}", status_code=200, responses=documented(DeletedFile, "the file is gone"))
    async def remove(self, request: Request, file_id: FromPath[str], files: NamedDependency[Files]) -> Response:
        FILE.found(await files.delete(file_id, caller_owner(request)), file_id)
        return json_response(DeletedFile(file_id))
