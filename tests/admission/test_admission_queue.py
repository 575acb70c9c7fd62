"""Admission: --max-queued-requests refuses the excess at once with a real 503.

One server: two engine slots and two queue places, so four requests may be in flight and
the fifth is refused (free engine slots are not queue). Every refusal is the OpenAI error
JSON with ``Retry-After``, for SSE, plain JSON, the openai SDK and the WebSocket alike.
"""

from __future__ import annotations

import json

import openai
import pytest
import trio
import trio_websocket

from admission_clients import (
    StreamResult,
    async_client,
    completion_body,
    metrics_async,
    rejected,
    stream,
    wait_for_async,
)

MAX_NUM_SEQS = 2
MAX_QUEUED = 2
MAX_BODY = 4096
QUEUE_FULL = {"message": "The request queue is full.", "type": "service_unavailable", "param": None,
              "code": 503}


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--engine-threads", "1", "--max-num-seqs", str(MAX_NUM_SEQS),
               "--max-queued-requests", str(MAX_QUEUED), "--min-step-time", "0.05",
               "--max-request-body-bytes", str(MAX_BODY))


def in_flight(m: dict[str, float]) -> float:
    return m["tidal:frontend_requests_active"]


async def test_twelve_simultaneous_streams_get_exactly_four_200s_and_eight_503s(server):
    before = rejected(await metrics_async(server), "queue_full")
    results = [StreamResult() for _ in range(12)]
    async with async_client(server) as client, trio.open_nursery() as nursery:
        for r in results:
            nursery.start_soon(stream, client, completion_body(60), "/v1/completions", r)

    admitted = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status != 200]
    assert len(admitted) == MAX_NUM_SEQS + MAX_QUEUED == 4
    assert len(refused) == 8
    for r in refused:
        # a real status before any byte of a stream, never a 200 with an error frame
        assert r.status == 503
        assert r.headers["content-type"] == "application/json"
        assert r.headers["retry-after"] == "1"
        assert r.error == QUEUE_FULL
        assert not r.chunks
    for r in admitted:
        assert r.error is None and r.done
        assert r.usage["completion_tokens"] == 60 and r.finish_reason == "length"
    # refused at once: long before any admitted request could have finished
    slowest_refusal = max(r.answered_at - r.sent_at for r in refused)
    quickest_admitted = min(r.chunk_times[-1] - r.sent_at for r in admitted)
    assert slowest_refusal < quickest_admitted
    m = server.wait_idle()
    assert rejected(m, "queue_full") - before == 8


async def test_bound_is_n_admitted_and_n_plus_one_refused_for_every_kind_of_client(server):
    """Four long requests fill two slots and two queue places; then each client kind gets its 503."""
    m0 = await metrics_async(server)
    before = rejected(m0, "queue_full")
    holders = [StreamResult() for _ in range(MAX_NUM_SEQS + MAX_QUEUED)]
    async with async_client(server) as client, trio.open_nursery() as nursery:
        for r in holders:  # one at a time, so each is admitted while the previous ones are in flight
            nursery.start_soon(stream, client, completion_body(400), "/v1/completions", r)
            n = holders.index(r) + 1
            await wait_for_async(server, lambda m, n=n: in_flight(m) == n)
        m = await wait_for_async(server, lambda m: m["tidal:num_requests_running"] == MAX_NUM_SEQS
                                 and m["tidal:num_requests_waiting"] == MAX_QUEUED)
        assert rejected(m, "queue_full") == before  # N in flight: nobody refused

        # N + 1, plain JSON request
        t0 = trio.current_time()
        response = await client.post("/v1/completions", json={**completion_body(5), "stream": False})
        assert trio.current_time() - t0 < 5.0  # at once, while the holders run for 20 s
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.json() == {"error": QUEUE_FULL}

        # N + 1, the openai SDK streaming (no retries: tidal's Retry-After is for the caller to honour)
        sdk = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            await sdk.completions.create(model="tidal-tiny", prompt="hi", max_tokens=5, stream=True)
        assert info.value.status_code == 503
        assert info.value.response.headers["retry-after"] == "1"
        assert info.value.body == QUEUE_FULL
        await sdk.close()

        # N + 1 on the WebSocket: an error message with the HTTP status, not a closed socket
        async with trio_websocket.open_websocket_url(server.url.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send_message(json.dumps({"type": "request", "id": "w1", "endpoint": "completions",
                                              "body": completion_body(5)}))
            with trio.fail_after(10):
                reply = json.loads(await ws.get_message())
        assert reply == {"type": "error", "id": "w1", "status": 503, "error": QUEUE_FULL, "retry_after": 1}

        m = await metrics_async(server)
        assert rejected(m, "queue_full") - before == 3
        assert in_flight(m) == 4  # the refusals touched none of the admitted requests
        nursery.cancel_scope.cancel()  # the holders disconnect: their blocks must come back
    assert all(r.status in (0, 200) for r in holders)
    server.wait_idle()


async def test_a_place_freed_by_a_leaving_client_admits_exactly_one_more(server):
    """The bound counts requests in flight, not requests seen: a queued client that leaves frees its place."""
    before = rejected(await metrics_async(server), "queue_full")

    async def hold(result: StreamResult, scope: trio.CancelScope) -> None:
        with scope:
            await stream(client, completion_body(400), "/v1/completions", result)

    async with async_client(server) as client, trio.open_nursery() as nursery:
        scopes = [trio.CancelScope() for _ in range(5)]
        results = [StreamResult() for _ in range(5)]
        for i in range(4):
            nursery.start_soon(hold, results[i], scopes[i])
            await wait_for_async(server, lambda m, n=i + 1: in_flight(m) == n)
        await wait_for_async(server, lambda m: m["tidal:num_requests_waiting"] == MAX_QUEUED)
        scopes[3].cancel()  # a queued request's client goes away
        await wait_for_async(server, lambda m: in_flight(m) == 3 and m["tidal:num_requests_waiting"] == 1)
        nursery.start_soon(hold, results[4], scopes[4])  # takes the freed place
        await wait_for_async(server, lambda m: in_flight(m) == 4 and m["tidal:num_requests_waiting"] == 2)
        refused = await client.post("/v1/completions", json=completion_body(3))  # and the bound holds again
        assert refused.status_code == 503
        m = await metrics_async(server)
        assert rejected(m, "queue_full") - before == 1
        nursery.cancel_scope.cancel()
    assert [r.status for r in results[:2]] == [200, 200]  # the running ones had started streaming
    server.wait_idle()


async def test_request_body_bound_at_n_and_n_plus_one_bytes(server):
    def body_of(size: int) -> bytes:
        base = {"prompt": "hi", "max_tokens": 1, "user": ""}
        pad = size - len(json.dumps(base, separators=(",", ":")))
        return json.dumps({**base, "user": "x" * pad}, separators=(",", ":")).encode()

    async with async_client(server) as client:
        headers = {"Content-Type": "application/json"}
        at = await client.post("/v1/completions", content=body_of(MAX_BODY), headers=headers)
        over = await client.post("/v1/completions", content=body_of(MAX_BODY + 1), headers=headers)
    assert len(body_of(MAX_BODY)) == MAX_BODY
    assert at.status_code == 200, at.text
    assert over.status_code == 413
    assert over.json()["error"]["message"] == f"Request body too large (the limit is {MAX_BODY} bytes)."
    server.wait_idle()
