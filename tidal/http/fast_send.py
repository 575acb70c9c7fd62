"""A cheaper socket write for hypercorn's Trio worker: the streaming hot path.

hypercorn's ``TCPServer.protocol_send`` takes a trio.Lock, opens a shielded cancel scope and
goes through trio's ``send_all`` (conflict detector, checkpoints, wait_writable) for every
chunk: about 33 us per SSE frame on this stack (see docs/performance-history.md), more than the
rest of a token's frontend cost together. This wrapper offers the bytes to the kernel directly with a
non-blocking ``send``, under the connection's send lock (uncontended in the common case, so
acquiring it does not wait) to keep writes in order; only when the socket buffer is full (a
slow client) does it wait for the socket, and that wait, unlike hypercorn's, can be cancelled.

The streaming loop still checkpoints once per frame it sends (``Mailbox.take``), so a task
whose client vanished cannot spin; ``BodyWriter.send_now`` is the
synchronous variant the engine reader task uses for streams that have caught up. TLS connections and anything but raw
data keep hypercorn's path unchanged. If hypercorn's internals ever change shape, ``install``
leaves the original in place.
"""

from __future__ import annotations

import logging
import socket
import time

import trio

log = logging.getLogger("tidal.http.fast_send")

_installed = False


def install() -> bool:
    """Wrap ``hypercorn.trio.tcp_server.TCPServer.protocol_send``. Idempotent; False if not possible."""
    global _installed
    if _installed:
        return True
    try:
        from hypercorn.events import RawData
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:  # pragma: no cover - hypercorn without its trio worker
        return False
    original = TCPServer.protocol_send

    async def protocol_send(self, event) -> None:
        if type(event) is RawData:
            raw = getattr(getattr(self.stream, "socket", None), "_sock", None)  # plain TCP only
            if raw is not None:
                await _locked_send(self, raw, event.data)
                return
        await original(self, event)

    original_run = TCPServer.run

    async def run(self) -> None:
        peer = None
        try:
            peer = self.stream.socket.getpeername()[:2]
            _connections[peer] = self
        except (AttributeError, OSError):  # TLS or already gone: no direct writes
            pass
        try:
            await original_run(self)
        finally:
            if peer is not None and _connections.get(peer) is self:
                del _connections[peer]

    TCPServer.protocol_send = protocol_send
    TCPServer.run = run
    _install_chunk_framing()
    _install_first_byte_stamp()
    _installed = True
    return True


# hypercorn connection (TCPServer) of each plain-TCP client, by peer address = ASGI scope["client"]
_connections: dict = {}


class BodyWriter:
    """Writes a streaming response's body chunks straight to its connection's socket.

    Used for SSE frames once the response headers are out: each frame becomes one chunk of the
    chunked body, framed here as h11 would frame it, and goes to the kernel with one
    non-blocking send under the connection's send lock, skipping quart's body loop, hypercorn's
    ASGI ``app_send`` and h11's event machinery, which cost more per frame than everything tidal
    does for a token. Only valid while h11 is in SEND_BODY with chunked framing; ``write``
    checks that on every call and returns False when the caller must use the ASGI path.
    The end of the body still goes through ASGI (h11 writes the terminating chunk).
    """

    __slots__ = ("_server", "_raw", "_h11", "_send_body", "_chunked")

    def __init__(self, server, raw, h11_protocol, send_body, chunked):
        self._server = server
        self._raw = raw
        self._h11 = h11_protocol
        self._send_body = send_body
        self._chunked = chunked

    async def write(self, data: bytes) -> bool:
        connection = self._h11.connection
        if connection.our_state is not self._send_body or type(connection._writer) is not self._chunked:
            return False
        await _locked_send(self._server, self._raw, b"%x\r\n%s\r\n" % (len(data), data))
        return True

    def ready(self) -> bool:
        """The response is in its chunked body: ``write`` and ``send_now`` may write chunks."""
        connection = self._h11.connection
        return connection.our_state is self._send_body and type(connection._writer) is self._chunked

    def send_now(self, data: bytes) -> bytes | None:
        """Offer one chunk to the kernel without waiting, from any task. Only after ``ready()``
        said True with no write of this body since (the response cannot leave the chunked body
        state then: only its own writes move it on).

        None: nothing was sent (a write in progress, the socket buffer full, the peer gone): use
        ``write``. Otherwise the framed chunk's tail the kernel did not take (b"" when it took
        all of it), which must go out (``write_framed``) before anything else. No checkpoint in
        between, so no other write can come between the check and the send.
        """
        if self._server.send_lock.locked():
            return None
        framed = b"%x\r\n%s\r\n" % (len(data), data)
        try:
            sent = self._raw.send(framed)
        except OSError:  # BlockingIOError included; a dead peer is met (and handled) by ``write``
            return None
        return framed[sent:]

    async def write_framed(self, framed: bytes) -> None:
        """The unsent tail ``send_now`` returned."""
        await _locked_send(self._server, self._raw, framed)


def body_writer(scope: dict) -> BodyWriter | None:
    """A direct writer for this HTTP/1.1 request's response body, or None (TLS, HTTP/2, not installed)."""
    if not _installed or scope.get("http_version") != "1.1" or scope.get("client") is None:
        return None
    server = _connections.get(tuple(scope["client"]))
    if server is None:
        return None
    raw = getattr(getattr(server.stream, "socket", None), "_sock", None)
    h11_protocol = getattr(getattr(server, "protocol", None), "protocol", None)
    if raw is None or not hasattr(h11_protocol, "connection"):
        return None
    try:
        import h11
        from h11._writers import ChunkedWriter
    except ImportError:  # pragma: no cover
        return None
    return BodyWriter(server, raw, h11_protocol, h11.SEND_BODY, ChunkedWriter)


def first_byte_time(scope: dict) -> float | None:
    """When this HTTP/1.1 request's first byte was read (``time.monotonic()``), taken once; None where
    it was not stamped (TLS, HTTP/2, not installed): the caller takes the scope's arrival instead."""
    client = scope.get("client")
    server = _connections.get(tuple(client)) if client else None
    if server is None:
        return None
    h11_protocol = getattr(getattr(server, "protocol", None), "protocol", None)
    stamp = getattr(h11_protocol, "tidal_first_byte", None)
    if stamp is not None:
        h11_protocol.tidal_first_byte = None  # the next request on the connection stamps its own
    return stamp


def _install_first_byte_stamp() -> None:
    """Stamp the read that brings a request's first byte: data that arrives while h11 waits for a new
    request (IDLE) starts one. The first such read counts (a head may take several reads), and the
    request's scope takes the stamp (``first_byte_time``)."""
    try:
        import h11
        from hypercorn.events import RawData
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:  # pragma: no cover
        return
    original = H11Protocol.handle
    idle = h11.IDLE

    async def handle(self, event) -> None:
        if type(event) is RawData and self.connection.their_state is idle \
                and getattr(self, "tidal_first_byte", None) is None:
            self.tidal_first_byte = time.monotonic()
        await original(self, event)

    H11Protocol.handle = handle


def _install_chunk_framing() -> None:
    """Frame response body chunks without h11's per-event state machine.

    In the SEND_BODY state of a chunked response, h11's ``send(Data)`` only validates the event
    and writes ``<hex length>\r\n<data>\r\n``; it records nothing. Writing that frame directly
    is the same bytes on the wire at a fraction of the cost. Any other state or framing
    (Content-Length bodies, HTTP/2, the end of the message) takes hypercorn's path.
    """
    try:
        import h11
        from h11._writers import ChunkedWriter
        from hypercorn.events import RawData
        from hypercorn.protocol.events import Body
        from hypercorn.protocol.h11 import H11Protocol
    except ImportError:  # pragma: no cover - other versions: keep hypercorn's path
        return
    original = H11Protocol.stream_send
    send_body = h11.SEND_BODY

    async def stream_send(self, event) -> None:
        if type(event) is Body:
            connection = self.connection
            data = event.data
            if data and connection.our_state is send_body and type(connection._writer) is ChunkedWriter:
                await self.send(RawData(data=b"%x\r\n%s\r\n" % (len(data), data)))
                return
        await original(self, event)

    H11Protocol.stream_send = stream_send


async def _locked_send(server, raw, data: bytes) -> None:
    """``_send_all`` under the connection's send lock, which keeps writes in order.

    The lock is uncontended unless a slow client's write is waiting, so taking it costs no
    scheduling round (``acquire`` would always yield).
    """
    lock = server.send_lock
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()
    try:
        await _send_all(server, raw, data)
    finally:
        lock.release()


async def _send_all(server, raw, data: bytes) -> None:
    """Write ``data``; wait for the socket (cancellably) only if the kernel buffer is full.

    hypercorn shields this wait, so a client that stops reading would pin its task, and
    with it server shutdown, forever. Here a cancellation (shutdown, the client's request
    scope) interrupts the wait; the connection is then cut, because a frame may be half
    written and the stream can no longer be continued.
    """
    view = memoryview(data)
    try:
        while True:
            try:
                view = view[raw.send(view):]
            except BlockingIOError:
                pass
            if not view:
                return
            await trio.lowlevel.wait_writable(raw)
    except OSError:
        from hypercorn.events import Closed

        await server.protocol.handle(Closed())  # the peer is gone
    except BaseException:
        try:
            raw.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise
