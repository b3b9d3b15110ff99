"""The built-in page: / (playground) and /dashboard (operator view), plus its files under /static.

Static files only: the page talks to the same public API as any client (/v1/chat/completions,
/v1/models, /metrics), sends the API key as a Bearer header when the server wants one, and loads
nothing from any other host. --no-ui turns it off.
"""

from __future__ import annotations

from pathlib import Path

from litestar import get
from litestar.response import File
from litestar.static_files import create_static_files_router

STATIC = Path(__file__).resolve().parent.parent / "static"


@get(["/", "/dashboard"], include_in_schema=False)
async def page() -> File:
    return File(STATIC / "index.html", content_disposition_type="inline", media_type="text/html")


static_files = create_static_files_router(path="/static", directories=[STATIC], include_in_schema=False)
UI_ROUTES = [page, static_files]
