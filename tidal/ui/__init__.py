"""The built-in chat page at ``/`` (``--no-ui`` turns it off) and the ``/state`` feed it polls.

The page is four static files next to this module (its icon included): plain HTML, CSS and JavaScript, no build
step, nothing fetched from elsewhere (the Content-Security-Policy forbids it). It streams over
``/v1/ws`` like any client. See docs/ui.md.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from quart import Response
from werkzeug.exceptions import NotFound

from tidal.observe.server_state import ServerState

_STATIC = Path(__file__).resolve().parent
_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css",
          "favicon.svg": "image/svg+xml"}
# same-origin only: the page may talk to this server and nothing else
# frame-ancestors: no other site may frame the page (clickjacking); nosniff: served types are final
_CSP = ("default-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'")


def register_state(app, state: ServerState) -> None:
    @app.get("/state")
    async def server_state():
        return Response(msgspec.json.encode(state.snapshot()), 200,
                        {"Content-Type": "application/json", "Cache-Control": "no-store"})


def register_ui(app) -> None:
    files = {name: (_STATIC / name).read_bytes() for name in _FILES}

    def static(name: str) -> Response:
        return Response(files[name], 200, {"Content-Type": f"{_FILES[name]}; charset=utf-8",
                                           "Cache-Control": "no-cache", "Content-Security-Policy": _CSP,
                                           "X-Content-Type-Options": "nosniff"})

    @app.get("/")
    async def index():
        return static("index.html")

    @app.get("/favicon.ico")  # where a browser looks without being told: a 404 there is noise in its console
    async def favicon():
        return static("favicon.svg")

    @app.get("/ui/<name>")
    async def asset(name: str):
        if name not in _FILES or name == "index.html":
            raise NotFound()
        return static(name)
