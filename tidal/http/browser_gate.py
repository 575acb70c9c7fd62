"""What a browser may do, in front of the app: the same policy for HTTP and the WebSocket.

A web page the user opens can send requests to a server on the user's machine: a "simple" POST
(``text/plain``, no preflight) is sent and served even though the page cannot read the answer, and
with DNS rebinding the page's own name resolves to the server, so the page is "same-origin" by the
``Host`` it sends. Without ``--api-key`` (the default) that is enough to run generation or evict
stored responses. So, as Ollama and Jupyter do:

* **Host**: when bound to a loopback address, only ``Host`` values naming it (``localhost``,
  ``127.0.0.1``, ``[::1]``, any port) are served; ``--allowed-hosts`` adds names ("*": any). A
  request without ``Host`` (not a browser) passes. Refused: 403.
* **Origin**: a request whose ``Origin`` is present and neither this server (by ``Host``) nor one
  of ``--allowed-origins`` ("*": any) is refused: 403. Clients that are not browsers send no
  ``Origin``. An allowed other origin gets CORS headers, and its preflight (``OPTIONS``) is answered.
* **Content type**: a POST to a route that takes JSON must say ``application/json`` (or a
  ``+json`` type): 415 otherwise. A page cannot send that cross-origin without a preflight.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from tidal.anthropic import errors as anthropic_errors
from tidal.errors import ApiError
from tidal.http.agent_routes import is_anthropic_path
from tidal.service.api import error_answer

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_PREFLIGHT_MAX_AGE = "600"
DRAIN_LIMIT = 64 * 1024  # a refused body read to keep its connection open


def is_loopback(bind_host: str) -> bool:
    if bind_host == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind_host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(host: str) -> str:
    """``Host`` without its port: ``[::1]:8000`` -> ``::1``, ``localhost:8000`` -> ``localhost``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this ``Origin`` (None: not a browser) may be served."""
    if origin is None or "*" in allowed or origin.rstrip("/") in allowed:
        return True
    if origin == "null" or host is None:  # a sandboxed or file:// page: never same-origin
        return False
    return urlsplit(origin).netloc.lower() == host.lower()


def is_json(content_type: str | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def browser_gate(app, bind_host: str, json_paths: frozenset[str], allowed_origins: tuple[str, ...] = (),
                 allowed_hosts: tuple[str, ...] = ()):
    """ASGI: apply the Host, Origin and content-type policy (module docstring) to HTTP and WebSocket.
    ``json_paths``: the POST routes that take a JSON body (others answer 404 or 405 as they do)."""
    origins = tuple(o.rstrip("/") for o in allowed_origins)
    hosts = None if "*" in allowed_hosts or not is_loopback(bind_host) else (
        LOOPBACK_NAMES | {host_name(h) for h in allowed_hosts})

    async def asgi(scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        host, origin = headers.get("host"), headers.get("origin")
        if hosts is not None and host is not None and host_name(host) not in hosts:
            return await refuse(scope, receive, send, ApiError(
                403, f"Host {host!r} is not served here (allow it with --allowed-hosts)", "permission_error"))
        if not origin_allowed(origin, host, origins):
            return await refuse(scope, receive, send, ApiError(
                403, f"Cross-origin request from {origin!r} refused (allow it with --allowed-origins)",
                "permission_error"))
        if scope["type"] == "websocket":
            return await app(scope, receive, send)
        cors = origin is not None and (urlsplit(origin).netloc.lower() != (host or "").lower())
        if scope["method"] == "OPTIONS" and cors and "access-control-request-method" in headers:
            return await _preflight(send, origin, headers.get("access-control-request-headers"))
        if scope["method"] == "POST" and scope["path"] in json_paths and not is_json(headers.get("content-type")):
            return await refuse(scope, receive, send, ApiError(
                415, "Request body must be JSON: send 'Content-Type: application/json'", "invalid_request_error"))
        if not cors:
            return await app(scope, receive, send)

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"access-control-allow-origin", origin.encode("latin-1")),
                                                  (b"vary", b"Origin")]}
            await send(message)

        return await app(scope, receive, send_with_cors)

    return asgi


async def _preflight(send, origin: str, requested_headers: str | None) -> None:
    headers = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
               (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
               (b"access-control-allow-headers", (requested_headers or "authorization, content-type").encode("latin-1")),
               (b"access-control-max-age", _PREFLIGHT_MAX_AGE.encode()), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 204, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def refuse(scope, receive, send, error: ApiError) -> None:
    """The refusal as a plain HTTP answer in the API's error shape (a WebSocket's before its handshake)."""
    if scope["type"] == "websocket":
        message = await receive()  # websocket.connect
        if message["type"] != "websocket.connect":
            return
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1008})
            return
        body = error.json()
        await send({"type": "websocket.http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    status, headers, body = (anthropic_errors.error_answer(error) if is_anthropic_path(scope["path"])
                             else error_answer(error))
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    if not await _drained(receive):  # the rest of a large body is not worth reading: close instead
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status,
                "headers": [*raw, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def _drained(receive) -> bool:
    """Read a refused request's body so the connection can serve the next request; False (the
    connection should close) once more than ``DRAIN_LIMIT`` bytes came without its end."""
    read = 0
    while read <= DRAIN_LIMIT:
        message = await receive()
        if message["type"] != "http.request":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
    return False
