"""200 streaming clients leave at the same moment: every request is aborted, the server shrugs.

Server: defaults (``--max-num-seqs 256``, ``--max-queued-requests 256``, so all 200 are
admitted and run in one batch), ``--min-step-time 0.05``.

What the step bound measures. The guarantee is the engine's: an abort's blocks are free at most
one step after the abort *arrives in the engine* (docs/cancellation.md). With one request the
frontend's share (disconnect -> cancel -> scope exit -> abort frame) is about a millisecond, so
the client-side step clock of test_cancel_disconnect (``S_f - S_d <= 1``, ``S_d`` scraped right
after the close) measures the guarantee. Here it does not: the frontend must unwind 200 handlers
and their connections before the last abort frame leaves, and on the shared 2-core host that
takes 0.5-2.4 s (load average 10-13), while a step is 0.05 s (0.3-0.6 s with 200 sequences on
that host); the ``S_d`` scrape itself is served somewhere inside that unwinding. So ``S_f - S_d``
counted the frontend's CPU share in engine steps (1-3, on this tree and the previous round's
alike; 8 with a profiler attached) and failed the old bound of 2 under whole-suite load without
any abort being slow in the engine (docs/cancellation.md, "What the guarantee is, exactly").
The engine therefore stamps each abort with its step count on arrival and counts, when the
report that shows the blocks free goes out, how many steps that was
(``tidal:engine_aborts_freed_total{steps=...}``): all 200 must be in "0" or "1". An engine that
kept a cancelled request's blocks for two or more steps after the abort arrived puts it in "2"
or "3+" and fails this test, however fast or slow the frontend was. The frontend's share is
bounded in wall-clock time (``wait_blocks_free``'s 10 s) and reported; ``S_f - S_d`` is printed.
"""

from __future__ import annotations

import time

import httpx
import trio

from cancel_helpers import (
    aborted,
    aborts_freed,
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
    freed = {n: aborts_freed(m_f, n) - aborts_freed(m0, n) for n in ("0", "1", "2", "3+")}
    print(f"abort storm: {NUM_CLIENTS} requests, engine steps from each abort's arrival to its blocks "
          f"free: {freed}; client step clock S_f - S_d = {steps(m_f) - steps(m_d)}; blocks free "
          f"{seconds * 1000:.0f} ms after the closes at {STEP} s/step")
    # Every abort freed a running request, and each within one step of reaching the engine (see the
    # module docstring). "0": it arrived after the step count moved, and the launch of the next
    # pass freed it; "1": it arrived during a pass and that pass's abort window freed it.
    assert sum(freed.values()) == NUM_CLIENTS, freed
    assert freed["2"] == freed["3+"] == 0, freed

    # still healthy and serving
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        assert (await client.get("/health")).status_code == 200
        response = await client.post("/v1/completions", json=completion_body("Hello", 4, stream=False))
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "length"
    m = server.wait_idle()
    assert aborted(m, "client_disconnect") == aborted(m0, "client_disconnect") + NUM_CLIENTS
