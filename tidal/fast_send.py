"""A cheaper socket write for hypercorn's Trio worker: the streaming hot path.

hypercorn's ``TCPServer.protocol_send`` takes a trio.Lock, opens a shielded cancel scope and
goes through trio's ``send_all`` (conflict detector, checkpoints, wait_writable) for every
chunk: about 33 us per SSE frame on this stack (see docs/performance.md), more than the
rest of a token's frontend cost together. When no other send is in progress on the
connection, this wrapper first offers the bytes to the kernel directly with one
non-blocking ``send``; only what the socket buffer cannot take (a slow client) goes through
hypercorn's original path, which then waits for the socket as before. Ordering is kept: the
shortcut is taken only while the connection's send lock is free, and it never awaits, so no
other send can interleave with it.

The streaming loop still checkpoints once per frame (``Mailbox.take``), so a task whose
client vanished cannot spin (stack-probe pitfall P3). TLS connections and anything but raw
data keep hypercorn's path unchanged. If hypercorn's internals ever change shape, ``install``
leaves the original in place.
"""

from __future__ import annotations

import logging

log = logging.getLogger("tidal.fast_send")

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
        if type(event) is RawData and not self.send_lock.locked():
            raw = getattr(getattr(self.stream, "socket", None), "_sock", None)  # plain TCP only
            if raw is not None:
                data = event.data
                try:
                    sent = raw.send(data)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    sent = 0  # broken: let hypercorn's path raise and close the connection
                if sent == len(data):
                    return
                if sent:
                    event = RawData(data[sent:])
        await original(self, event)

    TCPServer.protocol_send = protocol_send
    _installed = True
    return True
