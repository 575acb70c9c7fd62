"""Issue 9 item 4: ``--max-connections``. Past the bound a new connection gets a 503 and is
closed at once; connections already served, and the streams on them, carry on untouched.

This module runs its own server with ``--max-connections 4`` and steps of >= 50 ms, so the
stream opened first is still running while the refusals happen beside it.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from live_server import LiveServer

from .clients import Http1Connection

LIMIT = 4
STREAM_TOKENS = 40
REFUSAL = f"Too many connections (the server's limit is {LIMIT})."


@pytest.fixture(scope="module")
def limited_server():
    with LiveServer("--max-connections", str(LIMIT), "--min-step-time", "0.05",
                    "--num-kv-blocks", "128") as live:
        live.client.close()  # its keep-alive connection would take one of the four places
        live.client = httpx.Client(timeout=10)
        yield live


def served(port: int) -> bool:
    with Http1Connection(port, timeout=10) as conn:
        try:
            return conn.request("GET", "/v1/models")[0] == 200
        except ConnectionError:
            return False


def wait_until_served(port: int, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not served(port):
        assert time.monotonic() < deadline, "no place came free"
        time.sleep(0.05)


def refused(port: int, request: bytes) -> bytes:
    """Send ``request`` on a new connection; return everything until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_connections_past_the_bound_are_refused_and_the_others_go_on(limited_server):
    port = limited_server.port
    wait_until_served(port)  # the server holds no connection of ours
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": STREAM_TOKENS,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    stream = socket.create_connection(("127.0.0.1", port), timeout=30)
    stream.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = stream.recv(65536)
    assert received.startswith(b"HTTP/1.1 200"), received
    idle = [Http1Connection(port) for _ in range(LIMIT - 1)]  # the bound: four connections served
    for conn in idle:
        assert conn.request("GET", "/v1/models")[0] == 200

    started = time.monotonic()
    answers = [refused(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n") for _ in range(10)]
    answers.append(refused(port, b"GET /v1/ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                                 b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                 b"Sec-WebSocket-Version: 13\r\n\r\n"))
    refusals_s = time.monotonic() - started
    for answer in answers:
        head, _, error = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer
        assert b"retry-after: 1" in head.lower() and b"connection: close" in head.lower(), head
        assert json.loads(error) == {"error": {"message": REFUSAL, "type": "service_unavailable",
                                               "param": None, "code": 503}}
    print(f"\n{len(answers)} refusals in {refusals_s * 1000:.0f} ms")
    assert refusals_s < 5.0, refusals_s  # each is answered at once (the stream runs for ~2 s)

    while not received.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # the stream ran on to its end
        chunk = stream.recv(65536)
        assert chunk, received[-300:]
        received += chunk
    stream.close()
    assert b'"completion_tokens":%d' % STREAM_TOKENS in received, received[-500:]
    for conn in idle:  # and the idle connections are still served
        assert conn.request("GET", "/v1/models")[0] == 200
        conn.close()
    wait_until_served(port)  # places come free as soon as their clients close
    metrics = limited_server.metrics()
    assert metrics["tidal:connections_refused_total"] == len(answers)
    limited_server.wait_idle()


def test_the_default_bound_comes_from_the_fd_limit():
    import argparse
    import resource

    from tidal.http import connections
    from tidal.cli import add_serve_arguments, server_config

    fd_limit = connections.raise_fd_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fd_limit == soft == min(hard, connections.FD_TARGET) or hard == resource.RLIM_INFINITY
    assert connections.default_max_connections(1024) == 1024 - connections.FD_RESERVE
    assert connections.default_max_connections(100) == 1
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert server_config(parser.parse_args([])).max_connections is None  # derived at start
    assert server_config(parser.parse_args(["--max-connections", "7"])).max_connections == 7
    with pytest.raises(ValueError, match="--max-connections"):
        server_config(parser.parse_args(["--max-connections", "0"]))
