"""hypercorn's keep-alive timeout with ``tidal.http.connections.KeepAliveTimer`` (one timer task per
connection instead of one per idle period): an idle connection is closed after
``keep_alive_timeout``, a connection in use or one whose request outlasts the timeout is not, and
a worker that shuts down closes idle connections at once and busy ones once their response is out.

Real hypercorn (its Trio worker, patched by ``connections.install`` as ``tidal serve`` does)
and real sockets, with a short timeout and a bare ASGI app.
"""

from __future__ import annotations

import os

import hypercorn.config
import hypercorn.trio
import psutil
import trio

from tidal.http import connections

KEEP_ALIVE = 0.4


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await trio.sleep(3 * KEEP_ALIVE)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def start(nursery, shutdown: trio.Event) -> int:
    assert connections.install()
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.keep_alive_timeout = KEEP_ALIVE
    config.graceful_timeout = 5
    config.accesslog = None
    urls = await nursery.start(lambda task_status: hypercorn.trio.serve(
        app, config, shutdown_trigger=shutdown.wait, task_status=task_status))
    return int(urls[0].rsplit(":", 1)[1])


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def get(stream: trio.SocketStream, path: str = "/") -> bytes:
    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        chunk = await stream.receive_some(4096)
        assert chunk, f"closed after {received!r}"
        received += chunk
    return received


async def closed_by_server(stream: trio.SocketStream, within: float) -> bool:
    with trio.move_on_after(within):
        return await stream.receive_some(4096) == b""
    return False


async def test_idle_connections_close_after_the_timeout_and_busy_ones_do_not():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await start(nursery, shutdown)
        idle, busy = await connect(port), await connect(port)
        for stream in (idle, busy):
            assert b" 200 " in await get(stream)
        async with trio.open_nursery() as clients:
            async def keep_busy():
                for _ in range(6):  # 6 requests at KEEP_ALIVE / 2: never idle for the timeout
                    await trio.sleep(KEEP_ALIVE / 2)
                    assert b" 200 " in await get(busy)

            clients.start_soon(keep_busy)
            # the idle one goes after the timeout (not before half of it)
            assert not await closed_by_server(idle, KEEP_ALIVE / 2)
            assert await closed_by_server(idle, 2 * KEEP_ALIVE)
            # a request longer than the timeout keeps its connection, then it idles out
            slow = await connect(port)
            assert b" 200 " in await get(slow, "/slow")
        assert await closed_by_server(slow, 3 * KEEP_ALIVE)
        assert await closed_by_server(busy, 3 * KEEP_ALIVE)
        shutdown.set()


async def test_shutdown_closes_idle_connections_at_once_and_busy_ones_after_their_response():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await start(nursery, shutdown)
        idle, slow = await connect(port), await connect(port)
        assert b" 200 " in await get(idle)
        await slow.send_all(b"GET /slow HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        await trio.sleep(0.1)
        shutdown.set()
        assert await closed_by_server(idle, KEEP_ALIVE / 2)
        received = b""
        with trio.fail_after(5 * KEEP_ALIVE):
            while chunk := await slow.receive_some(4096):
                received += chunk
        assert received.endswith(b"\r\n\r\nok")  # answered, then closed


async def test_a_client_that_closes_ends_the_timer():
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await start(nursery, shutdown)
        for _ in range(20):
            stream = await connect(port)
            await get(stream)
            await stream.aclose()
        await trio.sleep(KEEP_ALIVE / 4)  # well before the keep-alive timeout
        me = psutil.Process(os.getpid())
        held = [c for c in me.net_connections(kind="tcp") if c.laddr and c.laddr.port == port
                and c.status == psutil.CONN_CLOSE_WAIT]
        assert held == []  # the server closed its side at once: no timer kept a socket open
        shutdown.set()
