"""The WebSocket handshake's path gate, in front of the app: a handshake on any path but ``/v1/ws``
(``/``, ``/health``, an unknown one) is a plain 404 before anything is accepted (the ASGI
``websocket.http.response`` extension; a bare close, which the server answers with 403, where that
is missing), with no traceback and no request task. Which origins and hosts may open it at all is
``browser_gate``'s, the same policy as for HTTP.
"""

from __future__ import annotations

from tidal.errors import ApiError
from tidal.http.browser_gate import refuse

WS_PATH = "/v1/ws"


def websocket_gate(app):
    """ASGI: refuse handshakes off ``/v1/ws`` (404); pass the rest to ``app``."""

    async def asgi(scope, receive, send):
        if scope["type"] == "websocket" and scope["path"] != WS_PATH:
            return await refuse(scope, receive, send, ApiError(
                404, f"WebSocket is served at {WS_PATH} only", "not_found_error"))
        return await app(scope, receive, send)

    return asgi
