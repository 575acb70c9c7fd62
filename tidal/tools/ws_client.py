"""A small Trio client for tidal's WebSocket endpoint (``/v1/ws``).

The protocol is JSON text messages, many requests interleaved on one connection:

* client -> server ``{"type": "request", "id": ID, "endpoint": "chat.completions" | "completions",
  "body": {...OpenAI request body; streaming is implied...}}``
* server -> client ``{"type": "chunk", "id": ID, "data": {...the object an SSE chunk carries...}}``,
  then ``{"type": "done", "id": ID, "usage": {...}}``
* client -> server ``{"type": "cancel", "id": ID}`` aborts one request
* server -> client ``{"type": "error", "id": ID | null, "status": 400, "error": {"message", "type",
  "param", "code"}}``; ``id`` is null for connection-level errors (e.g. an unparseable message).

Usage::

    async with open_tidal_ws("ws://127.0.0.1:8000/v1/ws", api_key=None) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}
        async with client.stream("chat.completions", body) as stream:
            async for data in stream:          # each chunk's ``data`` dict
                print(data["choices"][0]["delta"].get("content", ""), end="")
        print(stream.usage)                    # the ``done`` message's usage

``stream()`` returns a :class:`WSStream`: an async context manager that sends the request on entry
and, if the stream has not finished, sends ``cancel`` on exit (so breaking out of the loop or being
cancelled aborts the request on the server). Iterating it yields chunk ``data`` dicts and stops
after ``done``; an ``error`` message raises :class:`TidalWSError`; losing the connection raises
:class:`TidalWSConnectionLost`. ``client.cancel(request_id)`` aborts a request from anywhere; its
stream then stops iterating with ``stream.cancelled`` set.

One reader task, owned by the connection's nursery, receives every message and routes it by id
into that request's memory channel, so any number of streams can be consumed from different tasks
at once. A connection-level error (null id) cannot be attributed to a request, so it fails every
open stream (and is kept in ``client.connection_errors``).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio_websocket

__all__ = ["TidalWSClient", "TidalWSConnectionLost", "TidalWSError", "WSStream", "open_tidal_ws"]

# How long an exiting stream may spend telling the server to cancel; it runs shielded, so a
# dead peer must not hold up the caller's own cancellation for long.
_CANCEL_SEND_TIMEOUT_S = 2.0


class TidalWSError(Exception):
    """An ``error`` message from the server: ``status`` is HTTP-like, ``error`` the OpenAI error object."""

    def __init__(self, status: int | None, error: dict[str, Any]) -> None:
        self.status = status
        self.error = error
        super().__init__(f"{status}: {error.get('message', error)}")


class TidalWSConnectionLost(TidalWSError):
    """The WebSocket closed while a request was still streaming."""

    def __init__(self, reason: str) -> None:
        super().__init__(None, {"message": reason, "type": "connection_closed"})


class TidalWSConnectError(TidalWSError):
    """The connection could not be opened: nothing listens at the URL, or the server refused the handshake."""

    def __init__(self, url: str, cause: BaseException) -> None:
        reason = _handshake_reason(cause)
        super().__init__(None, {"message": f"could not connect to {url}: {reason}", "type": "connection_failed"})
        self.url = url

    def __str__(self) -> str:
        return self.error["message"]


def _handshake_reason(exc: BaseException) -> str:
    """What went wrong, in words: trio-websocket raises a bare HandshakeError whose causes say it."""
    if isinstance(exc, trio_websocket.ConnectionRejected):
        return f"the server refused the WebSocket handshake with HTTP {exc.status_code} (wrong path or API key?)"
    if isinstance(exc, trio_websocket.ConnectionTimeout):
        return "timed out opening the connection"
    causes = list(_causes(exc))
    if any(isinstance(cause, ConnectionRefusedError) for cause in causes):
        return "connection refused (is `tidal serve` running there?)"
    said = [str(cause) for cause in causes if str(cause)]
    return said[0] if said else type(exc).__name__


def _causes(exc: BaseException):
    """``exc``'s causes and contexts, groups opened, nearest first."""
    seen, pending = set(), [exc]
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if current is not exc:
            yield current
        pending += [current.__cause__, current.__context__]
        if isinstance(current, BaseExceptionGroup):
            pending += list(current.exceptions)


class TidalWSClient:
    """One open connection; create it with :func:`open_tidal_ws`."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws
        self._routes: dict[str, trio.MemorySendChannel[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._closed_reason: str | None = None
        self.connection_errors: list[TidalWSError] = []

    def stream(self, endpoint: str, body: dict[str, Any], request_id: str | None = None) -> WSStream:
        """A stream for one request; the request is sent when the stream's context is entered.

        ``endpoint`` is ``"chat.completions"`` or ``"completions"``; ``body`` the OpenAI request body.
        """
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        return WSStream(self, endpoint, body, request_id)

    async def cancel(self, request_id: str) -> None:
        """Ask the server to abort ``request_id``; its stream (if any) stops iterating."""
        self._unregister(request_id)  # its stream sees the channel end without a terminal message
        await self._send_json({"type": "cancel", "id": request_id})

    # -- internals ---------------------------------------------------------------------------

    async def _send_json(self, message: dict[str, Any]) -> None:
        if self._closed_reason is not None:
            raise TidalWSConnectionLost(self._closed_reason)
        try:
            await self._ws.send_message(json.dumps(message))
        except trio_websocket.ConnectionClosed as exc:
            raise TidalWSConnectionLost(f"connection closed: {exc.reason}") from exc

    def _register(self, request_id: str) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        if request_id in self._routes:
            raise ValueError(f"request id {request_id!r} is already streaming on this connection")
        if self._closed_reason is not None:
            raise TidalWSConnectionLost(self._closed_reason)
        # Unbounded: the reader must never block on one slow consumer, or every other stream on
        # the connection would stall behind it. Memory is bounded by what the server generates.
        send, receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        self._routes[request_id] = send
        return receive

    def _unregister(self, request_id: str) -> None:
        route = self._routes.pop(request_id, None)
        if route is not None:
            route.close()

    async def _read_messages(self) -> None:
        """The reader task: route each server message to its request's channel."""
        try:
            while True:
                raw = await self._ws.get_message()
                try:
                    message = json.loads(raw)
                except ValueError:
                    continue  # not ours to fix; a later message may still be fine
                if not isinstance(message, dict):
                    continue
                request_id = message.get("id")
                if request_id is None:
                    self._fail_all(message)
                    continue
                route = self._routes.get(request_id)
                if route is None:
                    continue  # late chunks of a request we already cancelled
                route.send_nowait(message)
                if message.get("type") in ("done", "error"):
                    self._unregister(request_id)
        except trio_websocket.ConnectionClosed as exc:
            self._lose_connection(f"connection closed: {exc.reason}")

    def _fail_all(self, message: dict[str, Any]) -> None:
        self.connection_errors.append(_error_from(message))
        for request_id in list(self._routes):
            self._routes[request_id].send_nowait(message)
            self._unregister(request_id)

    def _lose_connection(self, reason: str) -> None:
        self._closed_reason = reason
        for request_id in list(self._routes):
            self._routes[request_id].send_nowait({"type": "connection_lost", "reason": reason})
            self._unregister(request_id)


class WSStream:
    """One request's stream: an async context manager that is also an async iterator of chunk data.

    After iteration ends, ``usage`` holds the ``done`` message's usage (None if it had none, or if
    the stream was cancelled) and ``finished`` is True.
    """

    def __init__(self, client: TidalWSClient, endpoint: str, body: dict[str, Any], request_id: str) -> None:
        self.client = client
        self.endpoint = endpoint
        self.body = body
        self.request_id = request_id
        self.usage: dict[str, Any] | None = None
        self.finished = False
        self.cancelled = False
        self._receive: trio.MemoryReceiveChannel[dict[str, Any]] | None = None

    async def __aenter__(self) -> WSStream:
        self._receive = self.client._register(self.request_id)
        try:
            await self.client._send_json(
                {"type": "request", "id": self.request_id, "endpoint": self.endpoint, "body": self.body}
            )
        except BaseException:
            self.client._unregister(self.request_id)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self.finished:
            return
        self.client._unregister(self.request_id)
        self.finished = True
        # Shielded so a cancelled caller still tells the server to stop generating.
        with trio.CancelScope(shield=True), trio.move_on_after(_CANCEL_SEND_TIMEOUT_S):
            try:
                await self.client._send_json({"type": "cancel", "id": self.request_id})
            except TidalWSConnectionLost:
                pass  # nothing left to cancel on a closed connection

    def __aiter__(self) -> WSStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._receive is None:
            raise RuntimeError("use `async with client.stream(...) as stream:` before iterating")
        if self.finished:
            raise StopAsyncIteration
        while True:
            try:
                message = await self._receive.receive()
            except trio.EndOfChannel:
                # Closed without a terminal message: cancelled via client.cancel() elsewhere.
                self.finished = True
                self.cancelled = True
                raise StopAsyncIteration from None
            kind = message.get("type")
            if kind == "chunk":
                return message.get("data") or {}
            if kind == "done":
                self.finished = True
                self.usage = message.get("usage")
                raise StopAsyncIteration
            if kind == "connection_lost":
                self.finished = True
                raise TidalWSConnectionLost(message["reason"])
            if kind == "error":
                self.finished = True
                raise _error_from(message)
            # Any other type is a protocol extension this client predates: skip it.


def _error_from(message: dict[str, Any]) -> TidalWSError:
    error = message.get("error")
    if not isinstance(error, dict):
        error = {"message": str(error) if error is not None else f"unexpected message {message!r}"}
    status = message.get("status")
    return TidalWSError(status if isinstance(status, int) else None, error)


@asynccontextmanager
async def open_tidal_ws(url: str, api_key: str | None = None) -> AsyncIterator[TidalWSClient]:
    """Connect to ``url`` (e.g. ``ws://127.0.0.1:8000/v1/ws``) and yield a :class:`TidalWSClient`.

    ``api_key`` is sent as ``Authorization: Bearer <key>``. Leaving the block closes the
    connection and stops the reader task.
    """
    headers = [(b"Authorization", f"Bearer {api_key}".encode())] if api_key else None
    connection = trio_websocket.open_websocket_url(url, extra_headers=headers)
    try:
        ws = await connection.__aenter__()
    except (trio_websocket.HandshakeError, OSError) as exc:
        raise TidalWSConnectError(url, exc) from None
    async with _entered(connection, ws):
        client = TidalWSClient(ws)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client._read_messages)
                try:
                    yield client
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # The reader task handles its own failures, so a group only wraps what the caller's
            # block raised: hand that back unwrapped, as if no nursery were involved.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise


@asynccontextmanager
async def _entered(manager, value):
    """Run an already-entered async context manager's exit around a block (the connect was entered
    separately so that only its own failures become :class:`TidalWSConnectError`)."""
    try:
        yield value
    except BaseException as exc:
        if not await manager.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        await manager.__aexit__(None, None, None)
