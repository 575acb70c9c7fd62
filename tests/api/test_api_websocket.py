"""The WebSocket endpoint ``/v1/ws`` end to end, with ``tidal.tools.ws_client`` and raw trio-websocket.

Most tests use ``ws_server``: every engine step lasts >= 50 ms and three requests run at once
with one more queued, so a test can act while streams are mid-flight and can fill the queue.
The per-connection bound and the API key are checked on ``api_server``
(``--max-ws-requests-per-connection 2``, ``--api-key``). Metrics are polled from a thread so the
event loop keeps reading the socket meanwhile.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager

import httpx
import pytest
import trio
import trio_websocket

from tidal.tools.ws_client import TidalWSError, open_tidal_ws

from .support import API_KEY, AUTH, SERVED_MODEL

CANCEL = 'tidal:requests_aborted_total{model_name="tidal-tiny",reason="client_cancel"}'
DISCONNECT = 'tidal:requests_aborted_total{model_name="tidal-tiny",reason="client_disconnect"}'
QUEUE_FULL = 'tidal:requests_rejected_total{model_name="tidal-tiny",reason="queue_full"}'


def ws_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/ws"


def chat(content: str, max_tokens: int, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **fields}


async def wait_for(server, predicate, timeout: float = 10.0) -> dict[str, float]:
    return await trio.to_thread.run_sync(server.wait_for, predicate, timeout)


async def wait_idle(server) -> dict[str, float]:
    return await trio.to_thread.run_sync(server.wait_idle)


async def metrics(server) -> dict[str, float]:
    return await trio.to_thread.run_sync(server.metrics)


class RawWS:
    """A bare trio-websocket connection speaking JSON, for checking the protocol itself."""

    def __init__(self, ws: trio_websocket.WebSocketConnection):
        self.ws = ws

    async def send(self, message) -> None:
        await self.ws.send_message(message if isinstance(message, str) else json.dumps(message))

    async def request(self, rid, body: dict, endpoint: str = "chat.completions") -> None:
        await self.send({"type": "request", "id": rid, "endpoint": endpoint, "body": body})

    async def receive(self, timeout: float = 15.0) -> dict:
        with trio.fail_after(timeout):
            return json.loads(await self.ws.get_message())

    async def collect(self, ids, timeout: float = 30.0) -> dict:
        """Read until every id in ``ids`` got its terminal message; return id -> messages."""
        out: dict = {rid: [] for rid in ids}
        pending = set(ids)
        with trio.fail_after(timeout):
            while pending:
                message = await self.receive()
                out.setdefault(message["id"], []).append(message)
                if message["type"] in ("done", "error"):
                    pending.discard(message["id"])
        return out


@asynccontextmanager
async def raw_ws(server, api_key: str | None = None):
    headers = [(b"Authorization", f"Bearer {api_key}".encode())] if api_key else None
    async with trio_websocket.open_websocket_url(ws_url(server), extra_headers=headers) as ws:
        yield RawWS(ws)


def assert_done(messages: list[dict], max_tokens: int) -> str:
    """A complete stream: chunks, then ``done`` with usage; returns the text."""
    *chunks, done = messages
    assert done["type"] == "done" and done["usage"]["completion_tokens"] == max_tokens, done
    assert all(m["type"] == "chunk" for m in chunks)
    data = [m["data"] for m in chunks]
    assert data[0]["choices"][0]["delta"]["role"] == "assistant"
    assert data[-1]["choices"][0]["finish_reason"] == "length"
    return "".join(d["choices"][0]["delta"]["content"] for d in data)


# ------------------------------------------------------------------ streaming


async def test_three_interleaved_requests_on_one_connection(ws_server):
    arrivals: list[str] = []
    results: dict[str, tuple[str, dict]] = {}
    bodies = {f"r{i}": chat(f"Story number {i}", 12, temperature=0) for i in range(3)}

    async def run(client, rid):
        async with client.stream("chat.completions", bodies[rid], request_id=rid) as stream:
            parts = []
            async for data in stream:
                arrivals.append(rid)
                parts.append(data["choices"][0]["delta"]["content"])
                assert data["object"] == "chat.completion.chunk"
            assert data["choices"][0]["finish_reason"] == "length"
        results[rid] = ("".join(parts), stream.usage)

    async with open_tidal_ws(ws_url(ws_server)) as client:
        async with trio.open_nursery() as nursery:
            for rid in bodies:
                nursery.start_soon(run, client, rid)
    assert {rid: usage["completion_tokens"] for rid, (_, usage) in results.items()} == dict.fromkeys(bodies, 12)
    # interleaved: every request had a chunk before any other one finished
    last = {rid: max(i for i, r in enumerate(arrivals) if r == rid) for rid in bodies}
    first = {rid: arrivals.index(rid) for rid in bodies}
    assert max(first.values()) < min(last.values()), arrivals
    # the same text as the HTTP endpoint gives for the same body
    http = httpx.post(ws_server.url + "/v1/chat/completions", json=bodies["r1"], timeout=60).json()
    assert results["r1"][0] == http["choices"][0]["message"]["content"]
    await wait_idle(ws_server)


async def test_raw_protocol_messages(ws_server):
    async with raw_ws(ws_server) as ws:
        await ws.request(7, chat("Hi", 5), endpoint="chat.completions")
        await ws.request("c", {"prompt": "Once upon a time", "max_tokens": 4}, endpoint="completions")
        got = await ws.collect([7, "c"])
    assert assert_done(got[7], 5)
    for message in got[7][:-1]:
        assert set(message) == {"type", "id", "data"} and message["id"] == 7
    *chunks, done = got["c"]
    assert done == {"type": "done", "id": "c", "usage": done["usage"], "hops": done["hops"]} and done["usage"]["completion_tokens"] == 4
    assert [c["data"]["object"] for c in chunks] == ["text_completion"] * len(chunks)
    assert chunks[-1]["data"]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------ cancel and close


async def test_cancel_one_request_mid_stream(ws_server):
    before = await wait_idle(ws_server)
    async with raw_ws(ws_server) as ws:
        for rid in ("a", "b", "c"):
            await ws.request(rid, chat(f"Request {rid}", 30))
        seen: dict[str, list[dict]] = {"a": [], "b": [], "c": []}
        while min(len(v) for v in seen.values()) < 2:
            message = await ws.receive()
            seen[message["id"]].append(message)
        await ws.send({"type": "cancel", "id": "b"})
        # its engine state (and KV blocks) go while the others keep running
        await wait_for(ws_server, lambda m: m[CANCEL] == before[CANCEL] + 1 and m["tidal:num_requests_running"] == 2)
        rest = await ws.collect(["a", "b", "c"])
    assert rest["b"][-1] == {"type": "done", "id": "b", "usage": None, "cancelled": True}
    for rid in ("a", "c"):
        assert assert_done(seen[rid] + rest[rid], 30)
    await wait_idle(ws_server)


async def test_cancel_a_queued_request(ws_server):
    """A request cancelled before it was scheduled leaves the queue at once and gets its done."""
    before = await wait_idle(ws_server)
    async with raw_ws(ws_server) as ws:
        for rid in ("a", "b", "c"):
            await ws.request(rid, chat(f"Request {rid}", 30))
        await wait_for(ws_server, lambda m: m["tidal:num_requests_running"] == 3)
        await ws.request("queued", chat("Wait for me", 30))
        await wait_for(ws_server, lambda m: m["tidal:num_requests_waiting"] == 1)
        await ws.send({"type": "cancel", "id": "queued"})
        after = await wait_for(ws_server, lambda m: m["tidal:num_requests_waiting"] == 0
                               and m["tidal:frontend_requests_active"] == 3)
        assert after["tidal:num_requests_running"] == 3 and after[CANCEL] == before[CANCEL] + 1
        got = await ws.collect(["a", "b", "c", "queued"])
    assert got["queued"] == [{"type": "done", "id": "queued", "usage": None, "cancelled": True}]
    await wait_idle(ws_server)


async def test_ws_client_stream_exit_cancels_the_request(ws_server):
    before = await wait_idle(ws_server)
    async with open_tidal_ws(ws_url(ws_server)) as client:
        async with client.stream("chat.completions", chat("Hi", 40)) as stream:
            async for _ in stream:
                break  # leaving the block early sends "cancel"
        await wait_for(ws_server, lambda m: m[CANCEL] == before[CANCEL] + 1)
        # the connection is still good for the next request
        async with client.stream("completions", {"prompt": "Hi", "max_tokens": 3}) as stream:
            chunks = [data async for data in stream]
        assert stream.usage["completion_tokens"] == 3 and chunks
    await wait_idle(ws_server)


async def test_closing_the_connection_frees_its_requests(ws_server):
    before = await wait_idle(ws_server)
    async with raw_ws(ws_server) as ws:
        await ws.request(1, chat("One", 40))
        await ws.request(2, chat("Two", 40))
        seen = set()
        while seen != {1, 2}:
            seen.add((await ws.receive())["id"])
    # the socket is closed mid-stream: both requests are aborted and their blocks freed
    after = await wait_idle(ws_server)
    assert after[DISCONNECT] == before[DISCONNECT] + 2


# ------------------------------------------------------------------ errors


async def test_bad_messages_get_errors_and_the_connection_stays_usable(ws_server):
    async with raw_ws(ws_server) as ws:
        await ws.send("this is not json")
        error = await ws.receive()
        assert (error["type"], error["id"], error["status"]) == ("error", None, 400)
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["message"].startswith("Invalid message")

        await ws.send("[1, 2]")
        assert (await ws.receive())["id"] is None

        await ws.send({"type": "subscribe", "id": "t"})
        error = await ws.receive()
        assert (error["id"], error["status"], error["error"]["param"]) == ("t", 400, "type")

        await ws.send({"type": "request", "endpoint": "completions", "body": {"prompt": "x"}})
        error = await ws.receive()
        assert (error["id"], error["status"]) == (None, 400) and "'id'" in error["error"]["message"]

        await ws.send({"type": "request", "id": 0, "endpoint": "completions", "body": []})
        error = await ws.receive()  # a body that is not an object: the request's own error, with its id
        assert (error["id"], error["status"]) == (0, 400) and "'body' object" in error["error"]["message"]

        await ws.send({"type": "request", "id": "w", "endpoint": 5, "body": {}})
        error = await ws.receive()  # a field of the wrong type: the id is still read back
        assert (error["id"], error["status"]) == ("w", 400) and error["error"]["message"].startswith("Invalid message")

        await ws.request("e", {"prompt": "x"}, endpoint="embeddings")
        error = await ws.receive()
        assert (error["id"], error["status"], error["error"]["param"]) == ("e", 400, "endpoint")

        await ws.request("v", chat("Hi", 4, temperature=9))  # the body is validated like over HTTP
        error = await ws.receive()
        assert (error["id"], error["status"], error["error"]["param"]) == ("v", 400, "temperature")

        await ws.request("m", chat("Hi", 4, model="gpt-4o"))
        error = await ws.receive()
        assert (error["id"], error["status"], error["error"]["code"]) == ("m", 404, "model_not_found")

        await ws.request("d", chat("Hi", 10))
        await ws.request("d", chat("Again", 10))
        got = await ws.collect(["d"])
        duplicate = [m for m in got["d"] if m["type"] == "error"]
        assert len(duplicate) == 1 and duplicate[0]["status"] == 400
        assert "already streaming" in duplicate[0]["error"]["message"]
        if got["d"][-1]["type"] == "error":  # the original stream is still running: read it to its end
            got = await ws.collect(["d"])
        assert assert_done([m for m in got["d"] if m["type"] != "error"], 10)

        await ws.request("ok", chat("Still here?", 3))
        assert assert_done((await ws.collect(["ok"]))["ok"], 3)
    await wait_idle(ws_server)


async def test_queue_full_over_websocket(ws_server):
    """3 running + 1 queued fit; of five requests sent at once exactly one gets the 503."""
    before = await wait_idle(ws_server)
    async with raw_ws(ws_server) as ws:
        for i in range(5):
            await ws.request(i, chat(f"Request {i}", 20))
        got: dict = {i: [] for i in range(5)}
        while not any(m["type"] == "error" for messages in got.values() for m in messages):
            message = await ws.receive()
            got[message["id"]].append(message)
        # while the four run, HTTP is refused the same way, with a Retry-After
        response = await trio.to_thread.run_sync(lambda: httpx.post(
            ws_server.url + "/v1/chat/completions", json=chat("Hi", 4), timeout=30))
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["message"] == "The request queue is full."
        rest = await ws.collect([i for i, messages in got.items() if not messages or messages[-1]["type"] == "chunk"])
        for rid, messages in rest.items():
            got[rid] += messages
    errors = [messages[-1] for messages in got.values() if messages[-1]["type"] == "error"]
    assert len(errors) == 1, errors
    assert errors[0]["status"] == 503
    assert errors[0]["retry_after"] == 1  # the HTTP answer's Retry-After header, as a field
    assert errors[0]["error"]["message"] == "The request queue is full."
    assert errors[0]["error"]["type"] == "service_unavailable"
    assert len(got[errors[0]["id"]]) == 1  # refused before any chunk
    for rid, messages in got.items():
        if rid != errors[0]["id"]:
            assert assert_done(messages, 20)
    after = await wait_idle(ws_server)
    assert after[QUEUE_FULL] == before[QUEUE_FULL] + 2


# ------------------------------------------------------------------ per-connection bound, API key


async def test_per_connection_bound_answers_429(api_server):
    body = chat("Hi", 12, model=SERVED_MODEL)
    async with raw_ws(api_server, API_KEY) as ws:
        for rid in ("one", "two", "three"):
            await ws.request(rid, body)
        got = await ws.collect(["one", "two", "three"])
        (error,) = got["three"]
        assert error["type"] == "error" and error["status"] == 429
        assert error["error"]["type"] == "rate_limit_error"
        assert "the limit is 2" in error["error"]["message"]
        for rid in ("one", "two"):
            assert assert_done(got[rid], 12)
        # the bound is on concurrency: once those are done, the connection takes more
        await ws.request("four", body)
        assert assert_done((await ws.collect(["four"]))["four"], 12)
    await wait_idle(api_server)


async def test_per_connection_bound_with_the_client_library(api_server):
    body = chat("Hi", 12, model=SERVED_MODEL)
    async with open_tidal_ws(ws_url(api_server), api_key=API_KEY) as client:
        async with client.stream("chat.completions", body) as first, client.stream("chat.completions", body):
            with pytest.raises(TidalWSError) as info:
                async with client.stream("chat.completions", body) as third:
                    async for _ in third:
                        pass
            assert info.value.status == 429
            assert len([data async for data in first]) >= 1 and first.usage["completion_tokens"] == 12
    await wait_idle(api_server)


@pytest.mark.parametrize("key", [None, "wrong"])
async def test_websocket_needs_the_api_key(api_server, key):
    async with raw_ws(api_server, key) as ws:
        error = await ws.receive()
        assert (error["type"], error["id"], error["status"]) == ("error", None, 401)
        assert error["error"]["code"] == "invalid_api_key"
        with pytest.raises(trio_websocket.ConnectionClosed) as info:
            await ws.receive()
        assert info.value.reason.code == 1008
    assert httpx.get(api_server.url + "/v1/models", headers=AUTH).status_code == 200
