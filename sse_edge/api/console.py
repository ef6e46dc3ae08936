"""``/console``: the web console's page and its two files (sse_edge/console/), each with a strict
Content-Security-Policy: scripts and styles from this origin only, no inline code, no framing,
requests to this origin only. Only the files listed here are served."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import FileResponse, RedirectResponse, Response

from tokenbus.sse_edge.console import ASSETS
from tokenbus.sse_edge.errors import NotFound

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}
FILES = {"": ("index.html", "text/html; charset=utf-8"), "console.js": ("console.js", "text/javascript; charset=utf-8"),
         "console.css": ("console.css", "text/css; charset=utf-8")}


async def console(request: Request) -> Response:
    name = request.path_params.get("name", "")
    if name not in FILES:
        raise NotFound(f"No console file '{name}'.")
    file, media_type = FILES[name]
    return FileResponse(ASSETS / file, media_type=media_type, headers=HEADERS)


async def console_root(request: Request) -> Response:
    return RedirectResponse("/console/", status_code=308)
