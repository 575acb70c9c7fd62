"""Issue 9 item 1: JSON nested deeper than the decoder will go is a 400 (HTTP) or an error
message (WebSocket, the connection and its other streams carry on), never a 500 or a close.

Before the fix, msgspec's RecursionError escaped ``parse_body`` (500) and the WebSocket's
message decode (the whole connection closed, aborting its other streams).
"""

from __future__ import annotations

import json

import pytest
import trio

from .clients import Http1Connection, assert_openai_error, open_raw_ws

HELLO = [{"role": "user", "content": "Hello there"}]


def nested_objects(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


def chat_with(field: bytes) -> bytes:
    return b'{"messages":' + json.dumps(HELLO).encode() + b',"max_tokens":4,"unknown":' + field + b"}"


NESTED = "Request body is not valid JSON: it is nested too deeply"

# id: (path, body, the message when it matters)
DEEP_BODIES = {
    "1000-objects-in-unknown-field": ("/v1/chat/completions", chat_with(nested_objects(1000)), NESTED),
    "100k-arrays-in-unknown-field": ("/v1/chat/completions", chat_with(b"[" * 100_000 + b"]" * 100_000), NESTED),
    "16MiB-of-arrays-at-the-body-limit": ("/v1/chat/completions", b"[" * (16 << 20), None),
    "deep-in-messages": ("/v1/chat/completions", b'{"messages":' + b"[" * 5000 + b"]" * 5000 + b"}", None),
    "deep-prompt": ("/v1/completions", b'{"prompt":' + b"[" * 5000 + b"]" * 5000 + b"}", None),
}


@pytest.mark.parametrize("path, body, message", DEEP_BODIES.values(), ids=DEEP_BODIES)
def test_deep_json_is_a_400_and_the_connection_stays_usable(server, path, body, message):
    with Http1Connection(server.port) as conn:
        status, headers, response = conn.request("POST", path, body)
        error = assert_openai_error(status, headers, response, 400)
        assert error["type"] == "invalid_request_error"
        assert message is None or error["message"] == message, error
        assert conn.reusable
        status, _, response = conn.request("POST", "/v1/chat/completions",
                                           json.dumps({"messages": HELLO, "max_tokens": 2}).encode())
        assert status == 200 and json.loads(response)["usage"]["completion_tokens"] == 2
    server.wait_idle()


async def test_deep_json_on_the_websocket_is_an_error_and_other_streams_go_on(server):
    async with open_raw_ws(server) as ws:
        await ws.send({"type": "request", "id": "long", "endpoint": "chat.completions",
                       "body": {"messages": HELLO, "max_tokens": 30, "ignore_eos": True}})
        first = await ws.receive()
        assert first["type"] == "chunk" and first["id"] == "long", first
        deep_in_body = ('{"type":"request","id":"deep","endpoint":"chat.completions","body":'
                        + chat_with(nested_objects(1000)).decode() + "}")
        deep_message = '{"type":"request","id":"x","junk":' + "[" * 100_000 + "]" * 100_000 + "}"
        await ws.send(deep_in_body)
        await ws.send(deep_message)
        errors, long_stream = [], [first]
        with trio.fail_after(30):
            while len(errors) < 2 or long_stream[-1]["type"] != "done":
                message = await ws.receive()
                (long_stream if message["id"] == "long" else errors).append(message)
        for error in errors:
            assert error["type"] == "error" and error["status"] == 400, error
            assert set(error["error"]) == {"message", "type", "param", "code"}, error
        assert long_stream[-1]["usage"]["completion_tokens"] == 30  # untouched by its neighbours
        await ws.send({"type": "request", "id": "after", "endpoint": "completions",
                       "body": {"prompt": "Hi", "max_tokens": 2}})
        assert (await ws.until_final("after"))[-1]["type"] == "done"
    await trio.to_thread.run_sync(server.wait_idle)
