"""The transport's bounds at N and N+1, through a live ``tidal serve`` and raw clients:

* the request head: h11 (``h11_max_incomplete_size``, 16 KiB) refuses, with a 431, a head that is
  still incomplete after 16384 bytes; a head hypercorn reads whole in one receive (at most 64 KiB) is
  parsed whatever its size, so a head of 65537 bytes is refused even sent at once;
* a WebSocket message: 16 MiB passes, one byte more closes the connection with 1009.
"""

from __future__ import annotations

import json
import socket

import pytest
import trio
import trio_websocket

SERVER_ARGS = ("--model", "tidal-test", "--num-kv-blocks", "64", "--no-ui")
HEAD_BOUND = 16 * 1024  # hypercorn's default h11_max_incomplete_size
RECEIVE_SIZE = 64 * 1024  # hypercorn reads at most this much per receive (MAX_RECV)
WS_MESSAGE_BOUND = 16 * 1024 * 1024  # hypercorn's default websocket_max_message_size


def request_head(size: int) -> bytes:
    """A GET /health whose head (request line, headers, blank line) is ``size`` bytes."""
    start = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: "
    end = b"\r\n\r\n"
    return start + b"a" * (size - len(start) - len(end)) + end


def status_line(sock: socket.socket) -> bytes:
    received = b""
    while b"\r\n" not in received:
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received.split(b"\r\n")[0]


def send_incomplete_head(sock: socket.socket, size: int) -> bytes:
    """Send the first ``size`` bytes of a head of ``size + 4``; the rest (its blank line) is returned."""
    head = request_head(size + 4)
    sock.sendall(head[:size])
    return head[size:]


def test_an_incomplete_head_of_16_kib_waits_and_one_byte_more_is_a_431(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        rest = send_incomplete_head(sock, HEAD_BOUND)
        sock.settimeout(1.0)  # no answer yet: the server waits for the rest of the head
        with pytest.raises(TimeoutError):
            sock.recv(1)
        sock.settimeout(30)
        sock.sendall(rest)
        assert status_line(sock) == b"HTTP/1.1 200 "
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        send_incomplete_head(sock, HEAD_BOUND + 1)
        assert status_line(sock) == b"HTTP/1.1 431 "  # without the rest of the head


def test_a_head_larger_than_one_receive_is_a_431_even_sent_at_once(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request_head(RECEIVE_SIZE + 1))
        assert status_line(sock) == b"HTTP/1.1 431 "


def padded_cancel(size: int) -> str:
    """A valid message of exactly ``size`` bytes: a cancel of an unknown id, which gets no answer."""
    start = '{"type":"cancel","id":"none","pad":"'
    return start + "a" * (size - len(start) - 2) + '"}'


async def test_a_websocket_message_of_16_mib_passes_and_one_byte_more_closes_with_1009(server):
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    request = {"type": "request", "id": 1, "endpoint": "completions",
               "body": {"model": "tidal-test", "prompt": "hi", "max_tokens": 2}}
    with trio.fail_after(120):
        async with trio_websocket.open_websocket_url(url) as ws:
            await ws.send_message(padded_cancel(WS_MESSAGE_BOUND))
            await ws.send_message(json.dumps(request))  # the connection still serves
            messages = []
            while not messages or messages[-1]["type"] not in ("done", "error"):
                messages.append(json.loads(await ws.get_message()))
            assert messages[-1]["type"] == "done" and messages[-1]["usage"]["completion_tokens"] == 2
        async with trio_websocket.open_websocket_url(url) as ws:
            await ws.send_message(padded_cancel(WS_MESSAGE_BOUND + 1))
            try:
                await ws.get_message()
            except trio_websocket.ConnectionClosed as closed:
                assert closed.reason.code == 1009
            else:
                raise AssertionError("the server answered a message over the bound")
