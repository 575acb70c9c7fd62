"""The completion-style POSTs (chat, completions, Responses, Messages) as a bare ASGI handler, in front of quart.

For these routes quart's per-request machinery (a werkzeug request with its headers, the request
context, before-request hooks, URL dispatch, the Response object and its body loop) cost about a
quarter of the frontend's CPU per request: at 128 tokens per request, ~3 us per streamed token.
This handler does for them what quart did, in ASGI terms, and nothing else: it reads the body
(under the body limit and ``BODY_TIMEOUT``, 408 after), answers with the route's ``respond``
(the same answer quart's route sends), handing it the socket's direct writer
(``fast_send.body_writer``), and cancels the request when the client disconnects (as quart-trio
does: a second task waits for ``http.disconnect``), and closes its requests right then
(``RequestScope.close``: the engine's abort goes out before the handler unwinds).

What it does not handle the same way it leaves to quart before reading anything: other paths
and methods, a wrong or missing API key (quart's 401), a body without a Content-Length or
larger than the limit (quart's 413), a request under a root path.
"""

from __future__ import annotations

import hmac
import math

import trio

from tidal.errors import ApiError
from tidal.http import fast_send
from tidal.registry.frontend import RequestScope, current_request_scope
from tidal.service.api import Answer, Route


def completion_routes(app, routes: dict[str, Route], api_key: str | None):
    """ASGI: the POSTs of ``routes`` (by path) served here, everything else by ``app`` (the quart
    app, whose config holds the body limit and timeout)."""
    expected_authorization = None if api_key is None else f"Bearer {api_key}".encode()

    async def asgi(scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            route = routes.get(scope["path"])
            if route is not None:
                length = _body_length(scope["headers"], expected_authorization)
                if length is not None and length <= app.config["MAX_CONTENT_LENGTH"]:
                    return await _serve(route, app.config["BODY_TIMEOUT"], scope, receive, send)
        return await app(scope, receive, send)

    return asgi


def _body_length(headers, expected_authorization: bytes | None) -> int | None:
    """The body's Content-Length if the request is authorised and says it; else None (quart's case).
    The key is the ``Authorization`` header's, else an ``x-api-key`` header's (``auth.authorization``)."""
    length = None
    authorization = api_key = None
    for name, value in headers:
        if name == b"content-length":
            if not value.isdigit():
                return None
            length = int(value)
        elif name == b"transfer-encoding":
            return None
        elif name == b"authorization":
            authorization = value
        elif name == b"x-api-key":
            api_key = value
    if expected_authorization is not None:
        if authorization is None and api_key is not None:
            authorization = b"Bearer " + api_key
        if authorization is None or not hmac.compare_digest(authorization, expected_authorization):
            return None
    return length


async def _serve(route: Route, body_timeout: float | None, scope, receive, send) -> None:
    body = bytearray()
    with trio.move_on_after(math.inf if body_timeout is None else body_timeout) as timer:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
    if timer.cancelled_caught:
        return await _send_answer(send, route.error_answer(ApiError(
            408, f"Request body not received within {body_timeout:g} s.", "invalid_request_error")))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope, current_request_scope())
        answer = await route.respond(bytes(body), scope, fast_send.body_writer(scope))  # its own error boundary
        await _send_answer(send, answer)
        nursery.cancel_scope.cancel()


async def _cancel_on_disconnect(receive, cancel_scope: trio.CancelScope, requests: RequestScope | None) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    cancel_scope.cancel()
    # The engine hears of it now, not after the handler (and, in a storm, every other handler) has
    # unwound: the aborts of 200 clients leaving at once are sent in one scheduling round
    if requests is not None:
        requests.close()


async def _send_answer(send, answer: Answer) -> None:
    status, headers, content = answer
    raw_headers = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    if isinstance(content, bytes):
        raw_headers.append((b"content-length", b"%d" % len(content)))
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        await send({"type": "http.response.body", "body": content, "more_body": False})
        return
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    async for frame in content:
        await send({"type": "http.response.body", "body": frame, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
