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
all. tidal shields a response's final send (``http/request_scope._shield_final_send``, needed so that an
early 401/404/413 closes the connection properly), which arms the timer as hypercorn intends.)

**One keep-alive timer task per connection.** hypercorn's timer (``TrioSingleTask``) is a new
task for every idle period: each request cancelled one (under a lock) and each response spawned
the next through ``nursery.start``, a tenth of the frontend's CPU per request.
``KeepAliveTimer`` keeps one task per connection, parked for the connection's whole life; arming
and disarming only move its cancel scope's deadline, which wakes nobody.

If hypercorn's internals ever change shape, ``install`` leaves them alone and returns False.
"""

from __future__ import annotations

import logging
import math
import resource
import socket
import time
from collections.abc import Callable

import trio

from tidal.errors import ApiError

log = logging.getLogger("tidal.http.connections")

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
    if not all(hasattr(TCPServer, name) for name in ("_read_data", "_initiate_server_close")):
        return False  # pragma: no cover - another hypercorn
    original_read_data = TCPServer._read_data
    original_run = TCPServer.run

    async def run(self) -> None:
        self.idle_task = KeepAliveTimer(self)
        limit = getattr(self.config, "tidal_connection_limit", None)
        if limit is None:
            await original_run(self)
        else:
            await limit.serve(original_run, self)

    async def _read_data(self) -> None:
        await original_read_data(self)  # returns once the peer closed (or the read failed)
        self.idle_task.end()  # a response that completes after this has nothing to keep alive

    TCPServer.run = run
    TCPServer._read_data = _read_data
    _installed = True
    return True


class KeepAliveTimer:
    """hypercorn's keep-alive timer (``TCPServer.idle_task``: ``restart`` when a connection goes
    idle, ``stop`` when its next request starts) as one task per connection.

    Same behaviour as hypercorn's ``_idle_timeout``: a connection idle for ``keep_alive_timeout``
    seconds, or idle once the worker is terminating, is closed (``_initiate_server_close``,
    shielded). The task waits for the worker's termination under a cancel scope whose deadline
    is the idle deadline while armed and infinite otherwise, so arming and disarming wake no
    task. ``end`` (the peer closed: nothing to keep alive) ends it without closing.
    """

    __slots__ = ("_server", "_deadline", "_scope", "_started", "_ended", "_armed_lot")

    def __init__(self, server) -> None:
        self._server = server
        self._deadline = math.inf  # when the connection is closed for idleness (inf: not idle)
        self._scope: trio.CancelScope | None = None  # the task's wait, while it waits
        self._started = False
        self._ended = False
        self._armed_lot = trio.lowlevel.ParkingLot()  # the task waiting for the connection to go idle

    async def restart(self, task_group, action=None) -> None:
        """The connection is idle from now on (``action`` is hypercorn's; this class is its own)."""
        if self._ended:
            return
        self._set_deadline(trio.current_time() + self._server.config.keep_alive_timeout)
        if not self._started:
            self._started = True
            task_group._nursery.start_soon(self._run)
        self._armed_lot.unpark_all()

    async def stop(self) -> None:
        """A request started: the connection is not idle."""
        self._set_deadline(math.inf)

    def end(self) -> None:
        """Reading is over (the peer closed): stop the task without closing the connection."""
        self._ended = True
        self._set_deadline(math.inf)
        if self._scope is not None:
            self._scope.cancel()
        self._armed_lot.unpark_all()

    def _set_deadline(self, deadline: float) -> None:
        self._deadline = deadline
        if self._scope is not None:
            self._scope.deadline = deadline

    async def _run(self) -> None:
        server = self._server
        terminated = server.context.terminated
        while not self._ended:
            with trio.CancelScope(deadline=self._deadline) as scope:
                self._scope = scope
                await terminated.wait()
            self._scope = None
            if self._ended:
                return
            if math.isinf(self._deadline):  # terminating while a request runs: close once idle
                await self._armed_lot.park()
                continue
            with trio.CancelScope(shield=True):
                await server._initiate_server_close()
            return
