"""200 streaming clients leave at the same moment: every request is aborted, the server shrugs.

Server: defaults (``--max-num-seqs 256``, ``--max-queued-requests 256``, so all 200 are
admitted and run in one batch), ``--min-step-time 0.05``.
"""

from __future__ import annotations

import time

import httpx
import trio

from cancel_helpers import (
    aborted,
    completion_body,
    post_bytes,
    scrape,
    steps,
    unique_prompt,
    wait_blocks_free,
)

NUM_CLIENTS = 200
STEP = 0.05


async def _open_stream(port: int, body: dict, sockets: list) -> None:
    """Connect, send the request, return once the first SSE event arrived (socket kept open)."""
    sock = trio.socket.socket()
    sockets.append(sock)
    await sock.connect(("127.0.0.1", port))
    data = post_bytes(port, "/v1/completions", body)
    while data:
        data = data[await sock.send(data):]
    received = b""
    while b"data: " not in received:
        chunk = await sock.recv(1 << 16)
        assert chunk, f"connection closed before the first event: {received!r}"
        received += chunk
    assert received.startswith(b"HTTP/1.1 200"), received


async def test_abort_storm(wide_server):
    server = wide_server
    m0 = scrape(server)
    sockets: list = []
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for i in range(NUM_CLIENTS):
                    body = completion_body(unique_prompt(6, seed=300 + i), 1000)
                    nursery.start_soon(_open_stream, server.port, body, sockets)
        m = scrape(server)
        assert m["tidal:num_requests_running"] == NUM_CLIENTS
        assert m["tidal:frontend_requests_active"] == NUM_CLIENTS
        for sock in sockets:  # all at once: no checkpoint between the closes
            sock.close()
        closed_at = time.monotonic()
        m_d = scrape(server)
    finally:
        for sock in sockets:
            sock.close()
    m_f, _ = wait_blocks_free(server)
    seconds = time.monotonic() - closed_at
    print(f"abort storm: {NUM_CLIENTS} requests, S_f - S_d = {steps(m_f) - steps(m_d)}, "
          f"blocks free {seconds * 1000:.0f} ms after the closes at {STEP} s/step")
    # S_d, S_f as in test_cancel_disconnect. The 200 aborts reach the engine within a few
    # ms, but may straddle the mid-step drain of step S_d + 1: the ones that missed it
    # are found at the top of the loop; if some requests were freed by then the rest are
    # too, and the engine reports at once (still S_d + 1). Only if the last aborts arrive
    # after the engine already scheduled step S_d + 2 does that step free them: <= 2.
    assert steps(m_f) - steps(m_d) <= 2

    # still healthy and serving
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 200
        response = await client.post("/v1/completions", json=completion_body("Hello", 4, stream=False))
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect") + NUM_CLIENTS
