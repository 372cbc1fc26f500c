"""The web console: a chat playground, a live dashboard and the model's card.

Static files built into the package (``console_static/``; uPlot vendored for the plots, no
CDN, nothing fetched at run time), served at ``/`` and ``/console``. The page holds no
secret: when the server requires a key, the console asks for one, keeps it in the tab's
sessionStorage and sends it as ``Authorization: Bearer`` (never in a URL), and everything
it reads (the card, the chat endpoint) goes through the same key check as any client. The
dashboard plots from the server's own ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).with_name("console_static")

# The page itself may change with every release: browsers revalidate it; the static files
# are revalidated too (they are small, and a stale script beside a new page is worse).
_NO_CACHE = {"Cache-Control": "no-cache"}
# The key lives in the tab's sessionStorage: no script but the console's own may run, the
# page talks to this server only, and no other site may frame it.
_PAGE_HEADERS = {
    **_NO_CACHE,
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                               "style-src 'self' 'unsafe-inline'; object-src 'none'; "
                               "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def mount_console(app: FastAPI, info: Callable[[], dict[str, Any]]) -> None:
    """Serve the console at / and /console, its files at /console/static/, and the
    model's card at /console/api/info (behind the key check, like the API)."""
    index = STATIC_DIR / "index.html"

    @app.get("/", include_in_schema=False)
    @app.get("/console", include_in_schema=False)
    async def console_page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=_PAGE_HEADERS)

    @app.get("/console/api/info", tags=["console"])
    async def console_info() -> JSONResponse:
        """The model's card (architecture, weight and KV formats, context window, KV
        capacity), whether a key is required, and the configured cost per hour."""
        return JSONResponse(info(), headers=_NO_CACHE)

    app.mount("/console/static", _RevalidatedFiles(directory=STATIC_DIR),
              name="console-static")


class _RevalidatedFiles(StaticFiles):
    """Static files that browsers revalidate (ETag, Last-Modified) before each use: without
    ``Cache-Control`` a browser may keep a script by guesswork from its date, and run an
    old one beside a new page after an upgrade."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update({**_NO_CACHE, "X-Content-Type-Options": "nosniff"})
        return response
