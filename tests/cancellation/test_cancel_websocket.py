"""A WebSocket that closes mid-stream aborts every request multiplexed on it.

Two ways to leave: a proper close handshake (code 1000), and a bare TCP close with no
handshake at all (a crashed client, a dropped network). quart-trio cancels the
connection's nursery either way; the connection's RequestScope then aborts what it opened.
Server: defaults, ``--min-step-time 0.05``.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio_websocket

from cancel_helpers import aborted, completion_body, scrape, unique_prompt, wait_blocks_free

NUM_REQUESTS = 3


@pytest.mark.parametrize("how", ["close_handshake", "tcp_drop"])
async def test_websocket_close_aborts_all_its_requests(wide_server, how):
    server = wide_server
    m0 = scrape(server)
    async with trio.open_nursery() as nursery:
        stream = await trio.open_tcp_stream("127.0.0.1", server.port)
        ws = await trio_websocket.wrap_client_stream(nursery, stream, "127.0.0.1", "/v1/ws")
        for i in range(NUM_REQUESTS):
            body = completion_body(unique_prompt(6, seed=400 + i + (10 if how == "tcp_drop" else 0)), 1000)
            await ws.send_message(json.dumps({"type": "request", "id": i, "endpoint": "completions", "body": body}))
        streaming = set()
        with trio.fail_after(30):
            while len(streaming) < NUM_REQUESTS:
                message = json.loads(await ws.get_message())
                assert message["type"] == "chunk", message
                streaming.add(message["id"])
        m = scrape(server)
        assert m["tidal:num_requests_running"] == NUM_REQUESTS
        if how == "close_handshake":
            await ws.aclose()
        else:
            await stream.aclose()
        nursery.cancel_scope.cancel()
    m_f, seconds = wait_blocks_free(server)
    print(f"websocket {how}: {NUM_REQUESTS} requests' blocks free {seconds * 1000:.0f} ms after the close")
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect") + NUM_REQUESTS
    assert aborted(m, "client_cancel") == aborted(m0, "client_cancel")
