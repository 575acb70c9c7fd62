"""Raw clients for the hardening tests: one HTTP/1.1 connection driven by h11, one WebSocket."""

from __future__ import annotations

import json
import socket
from contextlib import asynccontextmanager
from typing import Any

import h11
import trio
import trio_websocket


class Http1Connection:
    """One keep-alive HTTP/1.1 connection; ``request`` returns (status, headers, body).

    Unlike a pooled client it never reconnects behind the test's back, so a test can tell
    whether the server kept the connection usable.
    """

    def __init__(self, port: int, timeout: float = 30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.h11 = h11.Connection(h11.CLIENT)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "Http1Connection":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request(self, method: str, path: str, body: bytes = b"", headers: list[tuple[str, str]] | None = None,
                content_type: str | None = "application/json") -> tuple[int, dict[str, str], bytes]:
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
        head = [("Host", "127.0.0.1"), ("Content-Length", str(len(body)))]
        if body and content_type is not None:
            head.append(("Content-Type", content_type))
        request = h11.Request(method=method, target=path, headers=head + (headers or []))
        self.sock.sendall(self.h11.send(request) + self.h11.send(h11.Data(data=body))
                          + self.h11.send(h11.EndOfMessage()))
        status, response_headers, chunks = None, {}, []
        while True:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                self.h11.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                response_headers = {k.decode().lower(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return status, response_headers, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError(f"the server closed the connection (status so far: {status})")

    @property
    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE


def assert_openai_error(status: int, headers: dict[str, str], body: bytes, expected: int | None = None) -> dict:
    """A 4xx with OpenAI's error JSON; returns the inner error object."""
    assert 400 <= status < 500 if expected is None else status == expected, (status, body[:500])
    assert headers["content-type"].startswith("application/json"), headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


class RawWS:
    """A bare trio-websocket connection speaking tidal's JSON protocol (docs/websocket.md)."""

    def __init__(self, ws: trio_websocket.WebSocketConnection):
        self.ws = ws

    async def send(self, message: Any) -> None:
        await self.ws.send_message(message if isinstance(message, (str, bytes)) else json.dumps(message))

    async def receive(self, timeout: float = 30.0) -> dict:
        with trio.fail_after(timeout):
            return json.loads(await self.ws.get_message())

    async def until_final(self, rid: Any, timeout: float = 30.0) -> list[dict]:
        """Messages for ``rid`` up to its ``done`` or ``error`` (others are dropped)."""
        out = []
        with trio.fail_after(timeout):
            while True:
                message = await self.receive()
                if message.get("id") == rid:
                    out.append(message)
                    if message["type"] in ("done", "error"):
                        return out


@asynccontextmanager
async def open_raw_ws(server):
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    async with trio_websocket.open_websocket_url(url) as ws:
        yield RawWS(ws)
