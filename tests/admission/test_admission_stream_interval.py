"""--stream-interval K (server default) and the per-request ``stream_interval``: a frame every
K tokens plus the last, and not a token lost.

Steps last 50 ms, so a reader on this machine keeps up and no frame is merged because of it;
if one ever is (the machine stalled the test for 50 ms), the coalescing counter says so and the
test only asserts what still must hold.
"""

from __future__ import annotations

import math

import trio

from admission_clients import async_client, completion_body, metrics_async, stream
from tidal.tools.ws_client import open_tidal_ws

SERVER_INTERVAL = 4
N = 13  # tokens per request: not a multiple of any interval tested but 1 and 13


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--engine-threads", "1", "--stream-interval", str(SERVER_INTERVAL),
               "--min-step-time", "0.05")


def coalesced(m: dict[str, float]) -> float:
    return m["tidal:stream_coalesced_chunks_total"]


async def test_frames_every_k_tokens_plus_the_last_and_no_token_lost(server):
    # None: the server default; the rest per request, including the bounds around N itself
    intervals = [None, 1, 5, N - 1, N, N + 1]
    m0 = await metrics_async(server)
    results = {}
    async with async_client(server) as client, trio.open_nursery() as nursery:
        async def run(k):
            extra = {} if k is None else {"stream_interval": k}
            results[k] = await stream(client, completion_body(N, **extra))

        for k in intervals:
            nursery.start_soon(run, k)
    merged = coalesced(await metrics_async(server)) > coalesced(m0)

    one_token_frames = [c["choices"][0]["text"] for c in results[1].chunks]
    for k, r in results.items():
        assert r.status == 200 and r.done
        assert r.usage["completion_tokens"] == N
        assert r.text == results[1].text  # lossless, whatever the interval
        assert r.finish_reason == "length"
        every = SERVER_INTERVAL if k is None else k
        expected = ["".join(one_token_frames[i:i + every]) for i in range(0, N, every)]
        frames = [c["choices"][0]["text"] for c in r.chunks]
        assert len(expected) == math.ceil(N / every)
        if not merged:
            assert frames == expected, f"stream_interval={k}"
        else:  # a merged read can only make frames bigger, never split them
            assert len(frames) <= len(expected), f"stream_interval={k}"
    assert len(results[None].chunks) == 4 or merged  # 4 + 4 + 4 + 1
    assert len(results[N].chunks) == 1 and len(results[N + 1].chunks) == 1
    server.wait_idle()


async def test_stream_interval_applies_to_websocket_streams(server):
    m0 = await metrics_async(server)
    body = {"prompt": "The tide comes in and the tide goes out", "max_tokens": N, "temperature": 0}
    async with open_tidal_ws(server.url.replace("http", "ws") + "/v1/ws") as ws:
        async with ws.stream("completions", {**body, "stream_interval": 5}) as s5:
            five = [chunk["choices"][0]["text"] async for chunk in s5]
        async with ws.stream("completions", body) as sd:
            default = [chunk["choices"][0]["text"] async for chunk in sd]
    merged = coalesced(await metrics_async(server)) > coalesced(m0)
    assert s5.usage["completion_tokens"] == sd.usage["completion_tokens"] == N
    assert "".join(five) == "".join(default)
    assert len(five) == 3 or (merged and len(five) < 3)
    assert len(default) == 4 or (merged and len(default) < 4)
    server.wait_idle()


async def test_stream_interval_below_one_is_refused(server):
    async with async_client(server) as client:
        response = await client.post("/v1/completions", json=completion_body(N, stream_interval=0))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "stream_interval"
    server.wait_idle()
