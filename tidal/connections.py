"""Connection housekeeping for hypercorn's Trio worker: a bound on open connections, and a
socket released as soon as its client is gone.

**The bound** (``--max-connections``). hypercorn accepts every connection it can; past the
process's fd limit, accept fails with EMFILE and trio's accept loop sleeps and retries, so
every client (and the engine pipes, and the model files) starves together. ``ConnectionLimit``
counts the connections hypercorn serves. One more is still accepted, but instead of reaching
hypercorn it gets a canned ``503`` (OpenAI's error JSON, ``Connection: close``, ``Retry-After``)
in one non-blocking send and is closed: it costs a task and an fd for at most
``REFUSAL_LINGER`` seconds (reading what the client sent, so that closing does not reset the
connection before the client read the answer), and no more than ``MAX_LINGERING`` refusals
linger at once (past that the socket is closed at once). Connections already served never
notice. The default leaves ``FD_RESERVE`` descriptors of the fd limit for everything else.

**Release on close.**
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

import logging
import resource
import socket
import time
from collections.abc import Callable

import trio

from tidal.protocol import ApiError

log = logging.getLogger("tidal.connections")

FD_RESERVE = 256  # descriptors kept for the process itself: engine pipes, model files, logs, refusals
FD_TARGET = 65536  # the soft fd limit is raised towards this (within the hard limit), as vLLM does
REFUSAL_LINGER = 1.0  # seconds a refused connection is read from before it is closed
MAX_LINGERING = 64  # refused connections lingering at once; past it they are closed at once


def raise_fd_limit(target: int = FD_TARGET) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``target`` (never above the hard limit); return it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # pragma: no cover - a sandbox may refuse
            pass
    return FD_TARGET if soft == resource.RLIM_INFINITY else soft


def default_max_connections(fd_limit: int) -> int:
    return max(1, fd_limit - FD_RESERVE)


class ConnectionLimit:
    """At most ``limit`` connections served at once; the rest are refused (see the module doc)."""

    def __init__(self, limit: int, on_refused: Callable[[], None] = lambda: None):
        self.limit = limit
        self.num_open = 0
        self.num_refused = 0
        self._on_refused = on_refused
        self._num_lingering = 0
        self._last_warning = 0.0
        body = ApiError(503, f"Too many connections (the server's limit is {limit}).",
                        "service_unavailable").json()
        self.refusal = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s"
                        % (len(body), body))

    async def serve(self, run, server) -> None:
        """Run hypercorn's connection handler ``run(server)`` if there is room, else refuse."""
        if self.num_open >= self.limit:
            await self._refuse(server.stream)
            return
        self.num_open += 1
        try:
            await run(server)
        finally:
            self.num_open -= 1

    async def _refuse(self, stream) -> None:
        self.num_refused += 1
        self._on_refused()
        now = time.monotonic()
        if now - self._last_warning > 10.0:
            self._last_warning = now
            log.warning("--max-connections (%d) reached: refusing new connections with a 503 "
                        "(%d refused so far)", self.limit, self.num_refused)
        sock = getattr(stream, "socket", None)  # a plain trio SocketStream; anything else is just closed
        try:
            if sock is not None:
                try:
                    sock._sock.send(self.refusal)  # fits an empty socket buffer: never waits
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                if self._num_lingering < MAX_LINGERING:
                    self._num_lingering += 1
                    try:
                        with trio.move_on_after(REFUSAL_LINGER):
                            while await stream.receive_some(65536):
                                pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    finally:
                        self._num_lingering -= 1
        finally:
            await stream.aclose()


_installed = False


def install() -> bool:
    """Patch ``hypercorn.trio.tcp_server.TCPServer``. Idempotent; False if not possible.

    The connection bound applies to servers whose hypercorn config carries a ``ConnectionLimit``
    as ``tidal_connection_limit`` (``tidal/server.py`` sets it).
    """
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
    original_run = TCPServer.run

    async def run(self) -> None:
        limit = getattr(self.config, "tidal_connection_limit", None)
        if limit is None:
            await original_run(self)
        else:
            await limit.serve(original_run, self)

    async def _read_data(self) -> None:
        await original_read_data(self)  # returns once the peer closed (or the read failed)
        self._tidal_peer_gone = True
        await self.idle_task.stop()

    async def _idle_timeout(self) -> None:
        if getattr(self, "_tidal_peer_gone", False):
            return  # a response that completed after the peer closed: nothing to keep alive
        await original_idle_timeout(self)

    TCPServer.run = run
    TCPServer._read_data = _read_data
    TCPServer._idle_timeout = _idle_timeout
    _installed = True
    return True
