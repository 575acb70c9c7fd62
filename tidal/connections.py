"""Connection housekeeping for hypercorn's Trio worker: release a socket once its client is gone.

hypercorn arms a keep-alive timer (``TCPServer._idle_timeout``, ``keep_alive_timeout``) each
time a response completes on a connection that stays open, and cancels it only when the next
request starts. When the client closes the idle connection instead, the reader sees EOF and
returns, but nothing stops the timer: ``TCPServer.run`` waits for it in its task group, so the
socket sits in CLOSE-WAIT, fd and all, for the whole timeout (75 s here). This module ends the
timer as soon as reading ends: the connection then closes as soon as its last response is out.

(A bare quart-trio app does not show this only by accident: its request task is cancelled while
hypercorn arms the timer, so the timer is never armed and idle connections are never closed at
all. tidal shields a response's final send (``frontend._shield_final_send``, needed so that an
early 401/404/413 closes the connection properly), which arms the timer as hypercorn intends.)

If hypercorn's internals ever change shape, ``install`` leaves them alone and returns False.
"""

from __future__ import annotations

_installed = False


def install() -> bool:
    """Patch ``hypercorn.trio.tcp_server.TCPServer``. Idempotent; False if not possible."""
    global _installed
    if _installed:
        return True
    try:
        from hypercorn.trio.tcp_server import TCPServer
    except ImportError:  # pragma: no cover - hypercorn without its trio worker
        return False
    if not all(hasattr(TCPServer, name) for name in ("_read_data", "_idle_timeout")):
        return False  # pragma: no cover - another hypercorn
    original_read_data = TCPServer._read_data
    original_idle_timeout = TCPServer._idle_timeout

    async def _read_data(self) -> None:
        await original_read_data(self)  # returns once the peer closed (or the read failed)
        self._tidal_peer_gone = True
        await self.idle_task.stop()

    async def _idle_timeout(self) -> None:
        if getattr(self, "_tidal_peer_gone", False):
            return  # a response that completed after the peer closed: nothing to keep alive
        await original_idle_timeout(self)

    TCPServer._read_data = _read_data
    TCPServer._idle_timeout = _idle_timeout
    _installed = True
    return True
