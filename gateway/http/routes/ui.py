"""The built-in page: / (playground) and /dashboard (operator view), plus its files under /static.

Static files only: the page talks to the same public API as any client (/v1/chat/completions,
/v1/models, /metrics), sends the API key as a Bearer header when the server wants one, and loads
nothing from any other host. --no-ui turns it off.

/static serves the files the folder held at start-up, looked up by name: a request's path never
reaches the file system, so a NUL byte (``app.js%00.png``), a file taken for a folder
(``index.html/x``) or ``..`` is a plain 404 (Litestar's static router gave a 500 for the first two).
"""

from __future__ import annotations

import mimetypes
from pathlib import Path

from litestar import get
from litestar.params import FromPath
from litestar.response import File

from gateway.errors import NotFound

STATIC = Path(__file__).resolve().parent.parent / "static"
FILES = {path.name: path for path in STATIC.iterdir() if path.is_file()}


@get(["/", "/dashboard"], include_in_schema=False)
async def page() -> File:
    return File(STATIC / "index.html", content_disposition_type="inline", media_type="text/html")


@get("/static/{name:str}", include_in_schema=False)
async def static_file(name: FromPath[str]) -> File:
    path = FILES.get(name)
    if path is None:
        raise NotFound(f"no file /static/{name}")
    return File(
        path,
        content_disposition_type="inline",
        media_type=mimetypes.guess_type(path.name)[0] or "application/octet-stream",
    )


UI_ROUTES = [page, static_file]
