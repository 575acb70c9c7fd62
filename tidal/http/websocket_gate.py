"""The WebSocket handshake's gate, in front of the app: which handshakes reach ``/v1/ws`` at all.

Two refusals, each a plain HTTP answer before anything is accepted (the ASGI
``websocket.http.response`` extension; a bare close, which the server answers with 403, where
that is missing), with no traceback and no request task:

* a handshake on any path but ``/v1/ws`` (``/``, ``/health``, an unknown one): 404;
* a handshake from a page on another origin: 403, unless ``--allowed-origins`` names it ("*": any).
  Without this, any web page the user opens could drive the local model and read its output over
  the user's browser (which sends no API key by itself, and none is needed by default). A client
  that is not a browser sends no ``Origin`` and passes; a page from this server is same-origin.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from tidal.errors import ApiError

WS_PATH = "/v1/ws"


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a handshake with this ``Origin`` (None: not a browser) may open the WebSocket."""
    if origin is None or "*" in allowed or origin in allowed:
        return True
    if origin == "null" or host is None:  # a sandboxed or file:// page: never same-origin
        return False
    return urlsplit(origin).netloc.lower() == host.lower()


def websocket_gate(app, allowed_origins: tuple[str, ...] = ()):
    """ASGI: refuse handshakes off ``/v1/ws`` (404) and from other origins (403); pass the rest to ``app``."""
    allowed = tuple(o.rstrip("/") for o in allowed_origins)

    async def asgi(scope, receive, send):
        if scope["type"] != "websocket":
            return await app(scope, receive, send)
        if scope["path"] != WS_PATH:
            return await _refuse(scope, receive, send, ApiError(
                404, f"WebSocket is served at {WS_PATH} only", "not_found_error"))
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        if not origin_allowed(headers.get("origin"), headers.get("host"), allowed):
            return await _refuse(scope, receive, send, ApiError(
                403, f"Cross-origin WebSocket from {headers['origin']!r} refused (allow it with --allowed-origins)",
                "permission_error"))
        return await app(scope, receive, send)

    return asgi


async def _refuse(scope, receive, send, error: ApiError) -> None:
    message = await receive()  # websocket.connect
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        body = error.json()
        await send({"type": "websocket.http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:
        await send({"type": "websocket.close", "code": 1008})
