"""Issue 23 rows 1, 2, 3, 6 and 14 at their reproduction, against a live server.

Each hostile input is sent while a neighbour streams on the same WebSocket: the input gets its
own 4xx (HTTP) or an error frame for its id (WebSocket), the neighbour's stream runs to its end,
the connection stays open, and the server is idle afterwards (every KV block free). Before the
fix, ``top_k: 2**64`` made the engine client's writer fail to encode and the server exit;
JSON nested 5,000 deep inside a field was a 500 (HTTP) or closed the whole WebSocket; a
WebSocket handshake on any other route was a 500 with a traceback in the log; a page on any
origin could open /v1/ws.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio_websocket

from .clients import Http1Connection, assert_openai_error, open_raw_ws

HELLO = [{"role": "user", "content": "Hello there"}]


def deep(depth: int, opener: str = "[", closer: str = "]") -> str:
    return opener * depth + "1" + closer * depth


FORCED_DEEP_TOOL = {"tools": [{"type": "function", "function": {
    "name": "f", "parameters": json.loads(deep(200, '{"a":', "}"))}}],
    "tool_choice": {"type": "function", "function": {"name": "f"}}}
# id: (path, ws endpoint, body fields)
HOSTILE = {
    "top-k-2**64": ("/v1/chat/completions", "chat.completions", {"messages": HELLO, "top_k": 2**64}),
    "top-k-2**64-completions": ("/v1/completions", "completions", {"prompt": "Hi", "top_k": 2**64}),
    "seed-2**64": ("/v1/chat/completions", "chat.completions", {"messages": HELLO, "seed": 2**64}),
    "priority-2**64": ("/v1/completions", "completions", {"prompt": "Hi", "priority": 2**64}),
    "stream-interval-2**64": ("/v1/completions", "completions", {"prompt": "Hi", "stream_interval": 2**64}),
    "prompt-id-2**64": ("/v1/completions", "completions", {"prompt": [1, 2**64]}),
    "guided-json-string-5000-deep": ("/v1/chat/completions", "chat.completions",
                                     {"messages": HELLO, "guided_json": deep(5000)}),
    "tool-call-arguments-5000-deep": ("/v1/chat/completions", "chat.completions", {"messages": [
        *HELLO, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                      "function": {"name": "f", "arguments": deep(5000)}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"}]}),
    "forced-tool-parameters-200-deep": ("/v1/chat/completions", "chat.completions", {"messages": HELLO,
                                                                                    **FORCED_DEEP_TOOL}),
}


def _call_with_function(function) -> list[dict]:
    """An earlier assistant turn whose tool call's ``function`` is ``function`` (an object in the API)."""
    return [*HELLO, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": function}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}]


# a tool call's function that is not an object was a 500 from the template's tool-call builder
for _name, _function in {"5": 5, "string": "ab", "list": [1, 2]}.items():
    for _stream in (False, True):
        HOSTILE[f"tool-call-function-{_name}{'-stream' if _stream else ''}"] = (
            "/v1/chat/completions", "chat.completions",
            {"messages": _call_with_function(_function), "stream": _stream})


@pytest.mark.parametrize("function", [5, "ab", [1, 2]], ids=["5", "string", "list"])
def test_tokenize_with_a_tool_call_function_not_an_object_is_a_400(server, function):
    with Http1Connection(server.port) as conn:
        status, headers, answer = conn.request("POST", "/tokenize", json.dumps(
            {"messages": _call_with_function(function)}).encode())
        assert_openai_error(status, headers, answer, 400)
        assert json.loads(answer)["error"]["param"] == "messages[1].tool_calls[0].function"
    assert server.process.poll() is None


@pytest.mark.parametrize("path, body", [(p, b) for p, _, b in HOSTILE.values()], ids=list(HOSTILE))
def test_hostile_field_is_a_400_and_the_server_serves_on(server, path, body):
    with Http1Connection(server.port) as conn:
        status, headers, answer = conn.request("POST", path, json.dumps({**body, "max_tokens": 2}).encode())
        assert_openai_error(status, headers, answer, 400)
        assert conn.reusable
        status, _, answer = conn.request("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
        assert status == 200 and json.loads(answer)["usage"]["completion_tokens"] == 2
    assert server.process.poll() is None
    server.wait_idle()


async def test_hostile_fields_on_the_websocket_are_error_frames_beside_a_live_stream(server):
    async with open_raw_ws(server) as ws:
        await ws.send({"type": "request", "id": "long", "endpoint": "chat.completions",
                       "body": {"messages": HELLO, "max_tokens": 40, "ignore_eos": True}})
        first = await ws.receive()
        assert first["type"] == "chunk" and first["id"] == "long", first
        for name, (_, endpoint, body) in HOSTILE.items():
            await ws.send({"type": "request", "id": name, "endpoint": endpoint, "body": {**body, "max_tokens": 2}})
        errors, long_stream = {}, [first]
        with trio.fail_after(60):
            while len(errors) < len(HOSTILE) or long_stream[-1]["type"] != "done":
                message = await ws.receive()
                if message["id"] == "long":
                    long_stream.append(message)
                else:
                    errors[message["id"]] = message
        for name, error in errors.items():
            assert error["type"] == "error" and error["status"] == 400, (name, error)
            assert set(error["error"]) == {"message", "type", "param", "code"}, error
        assert long_stream[-1]["usage"]["completion_tokens"] == 40  # untouched by its neighbours
        await ws.send({"type": "request", "id": "after", "endpoint": "completions",
                       "body": {"prompt": "Hi", "max_tokens": 2}})
        assert (await ws.until_final("after"))[-1]["type"] == "done"
    assert server.process.poll() is None
    await trio.to_thread.run_sync(server.wait_idle)


@pytest.mark.parametrize("path", ["/", "/health", "/metrics", "/v1/models", "/nope", "/v1/ws/"])
async def test_a_websocket_handshake_off_v1_ws_is_a_404_without_a_traceback(server, path):
    before = server.log()
    url = server.url.replace("http://", "ws://") + path
    with pytest.raises(trio_websocket.ConnectionRejected) as info:
        async with trio_websocket.open_websocket_url(url):
            pass
    assert info.value.status_code == 404
    assert json.loads(info.value.body)["error"]["type"] == "not_found_error"
    await trio.sleep(0.2)
    new = server.log()[len(before):]
    assert "Traceback" not in new and len(new.splitlines()) <= 1, new


@pytest.mark.parametrize("origin", ["https://evil.example", "null", "http://127.0.0.1:1"])
async def test_a_page_on_another_origin_cannot_open_the_websocket(server, origin):
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    with pytest.raises(trio_websocket.ConnectionRejected) as info:
        async with trio_websocket.open_websocket_url(url, extra_headers=[("Origin", origin)]):
            pass
    assert info.value.status_code == 403
    assert "--allowed-origins" in json.loads(info.value.body)["error"]["message"]


async def test_the_servers_own_page_and_non_browser_clients_open_the_websocket(server):
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    for headers in ([("Origin", server.url)], []):
        async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
            await ws.send_message(json.dumps({"type": "request", "id": 1, "endpoint": "completions",
                                              "body": {"prompt": "Hi", "max_tokens": 1}}))
            assert json.loads(await ws.get_message())["id"] == 1


def test_the_page_cannot_be_framed_or_sniffed(server):
    response = server.client.get(server.url + "/")
    assert response.status_code == 200
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    assert response.headers["x-content-type-options"] == "nosniff"
