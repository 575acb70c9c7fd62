"""The WebSocket endpoint ``/v1/ws``: many OpenAI requests multiplexed on one connection.

One connection is one nursery (quart-trio cancels it when the socket closes); each request
on it is a task with its own cancel scope, so a ``cancel`` message or a closed socket ends
exactly the requests it should, and each request's own RequestScope (tidal/registry/frontend.py) aborts
it in the engine. Requests run through the same ``Api.admit`` -> ``Api.first_output`` ->
``EventStream`` path as SSE (tidal/service/), with ``ChunkMessages`` as the renderer: each item
of the stream is one text message. Admission, queue timeouts, the slow-client bounds and the
error boundary apply unchanged. Protocol: docs/websocket.md. Registered by ``routes.create_app``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import trio
from msgspec import Meta
from quart import websocket

from tidal.errors import NESTED_TOO_DEEPLY, ApiError, bad_request, internal_error
from tidal.registry.frontend import open_request_scope
from tidal.http import auth
from tidal.http.websocket_gate import WS_PATH
from tidal.openai.encoding import ChatRenderer, ChunkEncoder
from tidal.service import body_cost
from tidal.service.api import Api
from tidal.service.reader import OutputReader
from tidal.service.stream import EventStream
from tidal.observe.timeline import Timeline

log = logging.getLogger("tidal.http.websocket")

_ENDPOINTS = {"chat.completions": "chat", "completions": "completions"}


# a request id is echoed in every frame of its stream: any string, or an integer JSON keeps exact
RequestId = str | Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class ClientMessage(msgspec.Struct):
    type: str
    id: RequestId | None = None
    endpoint: str | None = None
    body: Any = None  # checked in start(): not an object gets the request's own error, with its id
    traceparent: Any = None  # the caller's W3C trace context (with tracing on); anything but a string is ignored


class _MessageId(msgspec.Struct):
    id: RequestId | None = None


_decode = msgspec.json.Decoder(ClientMessage).decode
_decode_id = msgspec.json.Decoder(_MessageId).decode


def _readable_id(raw: bytes | str) -> str | int | None:
    """The id of a message that failed validation, where it has a valid one: the error then names the
    request it answers (a client waiting on that id would otherwise wait forever)."""
    try:
        return _decode_id(raw).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


_encode = msgspec.json.encode


def _error_message(request_id: Any, error: ApiError) -> str:
    message = {"type": "error", "id": request_id, "status": error.status, **error.body()}
    if "Retry-After" in error.headers:  # what the HTTP answer says in its header
        message["retry_after"] = int(error.headers["Retry-After"])
    return _encode(message).decode()


class ChunkMessages(ChatRenderer):
    """A WebSocket request's messages: each chunk wrapped with its id, then ``done`` with the usage and
    the hops of its way; an error is the request's error message."""

    content_frame = None  # no direct socket writes here: each item is one WebSocket message

    def __init__(self, rid: Any, encoder: ChunkEncoder, timeline: Timeline):
        super().__init__(encoder, False)
        self.rid = rid
        self.timeline = timeline
        self._prefix = b'{"type":"chunk","id":' + _encode(rid) + b',"data":'

    def frame(self, chunk: bytes) -> bytes:
        return self._prefix + chunk + b"}"

    def closing(self, reader: OutputReader) -> bytes:
        # the hops of its way, first byte to last frame (ms): the chat page draws them as a waterfall
        timeline = self.timeline
        hops = [[hop, round((end - start) * 1000, 3)] for hop, start, end in timeline.hops(timeline.last_written)]
        return _encode({"type": "done", "id": self.rid, "usage": reader.usage(), "hops": hops})

    def error_frame(self, error: ApiError) -> bytes:
        return _error_message(self.rid, error).encode()


def register_websocket(app, api: Api, max_requests: int, auth_error: Callable[[Any], ApiError | None]) -> None:
    """Serve ``/v1/ws``; ``auth_error(headers)`` is the HTTP routes' API-key check."""

    @app.websocket(WS_PATH)
    async def ws_endpoint():
        subprotocols = websocket.requested_subprotocols
        subprotocol = auth.accepted_subprotocol(subprotocols)
        error = auth_error({"Authorization": auth.authorization(websocket.headers, subprotocols)})
        if error is not None:
            await websocket.accept(subprotocol=subprotocol)
            await websocket.send(_error_message(None, error))
            await websocket.close(1008)
            return
        await websocket.accept(subprotocol=subprotocol)
        await Connection(api, max_requests).serve()


class Connection:
    def __init__(self, api: "Api", max_requests: int):
        self.api = api
        self.max_requests = max_requests
        self.streams: dict[Any, trio.CancelScope] = {}

    async def send(self, text: str) -> None:
        await websocket.send(text)

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                raw = await websocket.receive()
                received = time.monotonic()  # a request's clock starts at its message's arrival
                try:
                    # quart-trio hands an empty binary message over as None; a large one is scanned first
                    message = await body_cost.decode(raw or b"", _decode)
                except ApiError as error:  # past a bound of what its decode may cost
                    await self.send(_error_message(_readable_id(raw), error))
                    continue
                except msgspec.ValidationError as exc:  # JSON, but not a message: answer its id if it has one
                    await self.send(_error_message(_readable_id(raw), bad_request(f"Invalid message: {exc}")))
                    continue
                except msgspec.DecodeError as exc:  # not JSON (ValidationError is a DecodeError: caught first)
                    await self.send(_error_message(None, bad_request(f"Invalid message: {exc}")))
                    continue
                except RecursionError:  # an error message, not a closed connection
                    await self.send(_error_message(None, bad_request(NESTED_TOO_DEEPLY)))
                    continue
                if message.type == "request":
                    await self.start(nursery, message, received)
                elif message.type == "cancel":
                    scope = self.streams.get(message.id)
                    if scope is not None:
                        scope.cancel()
                else:
                    await self.send(_error_message(message.id, bad_request(
                        f"Unknown message type {message.type!r}: expected 'request' or 'cancel'", "type")))

    async def start(self, nursery: trio.Nursery, message: ClientMessage, received: float) -> None:
        rid = message.id
        if rid is None or not isinstance(message.body, dict):
            await self.send(_error_message(rid, bad_request("A request needs an 'id' and a 'body' object")))
        elif message.endpoint not in _ENDPOINTS:
            await self.send(_error_message(rid, bad_request(
                f"Unknown endpoint {message.endpoint!r}: expected 'chat.completions' or 'completions'",
                "endpoint")))
        elif rid in self.streams:
            await self.send(_error_message(rid, bad_request(f"Request id {rid!r} is already streaming", "id")))
        elif len(self.streams) >= self.max_requests:
            await self.send(_error_message(rid, ApiError(
                429, f"Too many concurrent requests on this connection (the limit is {self.max_requests}).",
                "rate_limit_error", None, 429)))
        else:
            scope = self.streams[rid] = trio.CancelScope()
            traceparent = message.traceparent if isinstance(message.traceparent, str) else None
            nursery.start_soon(self.stream, rid, _ENDPOINTS[message.endpoint], message.body, scope,
                               Timeline(received, traceparent))

    async def stream(self, rid: Any, kind: str, body: dict[str, Any], scope: trio.CancelScope,
                     timeline: Timeline) -> None:
        api = self.api
        try:
            # each request on the connection is its own RequestScope: a "cancel" ends just this one
            with open_request_scope(api.frontend) as requests:
                with scope:
                    try:
                        active, checked = await api.admit(kind, {**body, "stream": True}, timeline)
                        reader = await api.first_output(active, checked)
                    except ApiError as error:
                        await self.send(_error_message(rid, error))
                        return
                    renderer = ChunkMessages(rid, ChunkEncoder(kind, api.served_name(active)), timeline)  # type: ignore[arg-type]
                    async for message in EventStream(reader, renderer, separate_closing=True):
                        await self.send(message.decode())
                if scope.cancelled_caught:  # the client sent "cancel"
                    requests.close_reason = "client_cancel"
            if scope.cancelled_caught:
                await self.send(_encode({"type": "done", "id": rid, "usage": None, "cancelled": True}).decode())
        except Exception as exc:  # this request's error boundary: an error frame for its id, the connection lives
            log.exception("request %r on a WebSocket: unexpected error", rid)
            await self.send(_error_message(rid, internal_error(exc)))
        finally:
            self.streams.pop(rid, None)
