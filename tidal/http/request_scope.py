"""Every HTTP request and WebSocket connection is one scope of requests (``open_request_scope``).

ASGI middleware, outermost in the app: it starts the request's clock at its first byte and, at
the scope's exit, closes every request the handler opened that is not over.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import trio

from tidal.http import fast_send
from tidal.registry.frontend import Frontend, open_request_scope


def request_scope_middleware(app, frontend_getter: Callable[[], Frontend]):
    """ASGI wrapper: every HTTP request / WebSocket connection is one scope of requests."""

    async def asgi(scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await app(scope, receive, send)
        # the request's clock starts at its first byte (hypercorn's read of it), else now
        scope["tidal.received"] = fast_send.first_byte_time(scope) or time.monotonic()
        if scope["type"] == "http":
            send = _shield_final_send(send)
        with open_request_scope(frontend_getter()):
            await app(scope, receive, send)

    return asgi


def _shield_final_send(send):
    """Send a response's last message shielded from cancellation.

    When a response is answered before its request body was read (401, 404, 405, 413),
    hypercorn closes the connection from inside this send; quart-trio cancels the task as
    soon as its body reader sees the disconnect, which interrupted that close half-way and
    left the connection open and silent: the client's next request on it hung forever.
    (hypercorn already shields the socket write itself, so this adds no new blocking.)
    """

    async def shielded(message):
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                return await send(message)
        return await send(message)

    return shielded
