"""Stop strings and stop_token_ids: a 400 one past each documented bound, service at it, and
requests at the bounds do not stall anyone else.

Before linear stop matching, one request with 16 distinct stop strings of 4096 characters cost
the engine ~0.5 s to set up (a 40k one 1.6 s and 0.8 GB), during which no other stream moved;
eight of them stalled a neighbour's stream for seconds. Steps last >= 20 ms, so the neighbour gets a
token every ~20 ms when nothing stalls; the 1 s limit per token leaves a slow shared host a wide margin.
"""

from __future__ import annotations

import random

import httpx
import pytest
import trio

from admission_clients import PROMPT, async_client, completion_body, metrics_async, stream
from tidal.openai.requests import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--min-step-time", "0.02")


def distinct_stops(count: int, length: int, seed: int = 0) -> list[str]:
    """Stop strings that share no prefix (the worst case for a set of prefixes) and never occur."""
    rng = random.Random(seed)
    return [f"\x00{i:02d}" + "".join(rng.choice("ab") for _ in range(length - 3)) for i in range(count)]


def post(server, **fields) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


BOUNDS = [
    # (id, fields at the bound, fields one past it, param, a piece of the message)
    ("stop-count", {"stop": distinct_stops(MAX_STOP_STRINGS, 8)}, {"stop": distinct_stops(MAX_STOP_STRINGS + 1, 8)},
     "stop", f"at most {MAX_STOP_STRINGS} stop strings are supported (got {MAX_STOP_STRINGS + 1})"),
    ("stop-length", {"stop": distinct_stops(1, MAX_STOP_CHARS)}, {"stop": distinct_stops(1, MAX_STOP_CHARS + 1)},
     "stop", f"a stop string may have at most {MAX_STOP_CHARS} characters (got {MAX_STOP_CHARS + 1})"),
    ("stop-length-as-a-string", {"stop": "x" * MAX_STOP_CHARS}, {"stop": "x" * (MAX_STOP_CHARS + 1)},
     "stop", f"at most {MAX_STOP_CHARS} characters"),
    ("stop-token-ids", {"stop_token_ids": [7] * MAX_STOP_TOKEN_IDS}, {"stop_token_ids": [7] * (MAX_STOP_TOKEN_IDS + 1)},
     "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported (got {MAX_STOP_TOKEN_IDS + 1})"),
]


@pytest.mark.parametrize("at, past, param, message", [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_one_past_the_bound_is_a_400_and_the_bound_is_served(server, at, past, param, message):
    refused = post(server, **past)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == 400
    assert message in error["message"]
    served = post(server, **at)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] >= 1


async def test_requests_at_the_bounds_leave_a_neighbour_stream_flowing(server):
    # The greedy text the heavy requests will produce: their stop strings begin with it, so the
    # whole output is a partial match that is held back until the end (the most held text).
    async with async_client(server) as client:
        probe = await stream(client, completion_body(24))
    assert probe.status == 200
    output = probe.text
    heavy_stops = [output + tail[len(output):] for tail in distinct_stops(MAX_STOP_STRINGS, MAX_STOP_CHARS)]
    assert all(len(s) == MAX_STOP_CHARS for s in heavy_stops)

    results = {}
    async with async_client(server) as client, trio.open_nursery() as nursery:
        async def neighbour():
            results["neighbour"] = await stream(client, completion_body(120, logprobs=1))  # tokens per frame

        async def heavy(i):
            await trio.sleep(0.3 + 0.05 * i)  # while the neighbour streams
            results[i] = await stream(client, completion_body(24, stop=heavy_stops))

        nursery.start_soon(neighbour)
        for i in range(8):
            nursery.start_soon(heavy, i)

    n = results.pop("neighbour")
    assert n.status == 200 and n.finish_reason == "length" and n.usage["completion_tokens"] == 120
    # Per engine step, not per frame: a stalled engine makes one token after a long gap, while a neighbour
    # that a loaded host descheduled gets, after its gap, one frame of every token made meanwhile (merged).
    # A step lasts 20 ms here; 1 s per token holds at a load average of 8 and still sees the old stall.
    tokens = [len(chunk["choices"][0]["logprobs"]["tokens"]) for chunk in n.chunks]
    assert sum(tokens) == 120
    slowest = max(gap / count for gap, count in zip(n.gaps(), tokens[1:]))
    assert slowest < 1.0, f"the neighbour's stream stalled: {slowest:.2f} s for one engine step"
    for r in results.values():
        assert r.status == 200 and r.finish_reason == "length"
        assert r.text == output  # held back as a possible stop, released whole at the end
    m = await metrics_async(server)
    assert m["tidal:num_requests_running"] == 0
