"""Real clients for the admission tests: an httpx SSE reader that timestamps every frame,
and a raw-socket reader that can be made as slow as a bad mobile link.

Everything here talks HTTP to a live ``tidal serve`` (tests/live_server.py), like a user would.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

PROMPT = "The tide comes in and the tide goes out"


def completion_body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy streaming /v1/completions body (tidal-tiny never stops early: it runs to max_tokens)."""
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


def async_client(server, timeout: float = 120.0) -> httpx.AsyncClient:
    """An httpx client for the server with room for many concurrent streams."""
    return httpx.AsyncClient(base_url=server.url, timeout=timeout,
                             limits=httpx.Limits(max_connections=512, max_keepalive_connections=0))


@dataclass
class StreamResult:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None  # the OpenAI error object of a non-200 answer (or an error frame)
    chunks: list[dict[str, Any]] = field(default_factory=list)  # frames that carry a choice
    chunk_times: list[float] = field(default_factory=list)  # trio clock at each of them
    usage: dict[str, Any] | None = None
    done: bool = False  # saw data: [DONE]
    sent_at: float = 0.0
    answered_at: float = 0.0  # when the status line arrived
    ended: trio.Event = field(default_factory=trio.Event, repr=False)  # the whole answer is read

    @property
    def text(self) -> str:
        return "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                       for c in self.chunks)

    @property
    def finish_reason(self) -> str | None:
        return self.chunks[-1]["choices"][0]["finish_reason"] if self.chunks else None

    @property
    def first_chunk_at(self) -> float:
        return self.chunk_times[0]

    def gaps(self) -> list[float]:
        """Time between consecutive frames, as the client saw it."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


async def stream(client: httpx.AsyncClient, body: dict[str, Any], path: str = "/v1/completions",
                 result: StreamResult | None = None) -> StreamResult:
    """POST ``body`` and read the whole answer: SSE frames for a 200, the error JSON otherwise.

    Pass ``result`` to watch it fill in from another task (e.g. to see the status arrive).
    """
    r = result if result is not None else StreamResult()
    r.sent_at = trio.current_time()
    try:
        await _read_answer(client, body, path, r)
    finally:
        r.ended.set()
    return r


async def _read_answer(client: httpx.AsyncClient, body: dict[str, Any], path: str, r: StreamResult) -> None:
    async with client.stream("POST", path, json=body) as response:
        r.status = response.status_code
        r.headers = dict(response.headers)
        r.answered_at = trio.current_time()
        if response.status_code != 200 or not response.headers["content-type"].startswith("text/event-stream"):
            payload = json.loads(await response.aread())
            r.error = payload.get("error")
            if response.status_code == 200:
                r.chunks.append(payload)
            return
        async for line in response.aiter_lines():
            if record_event(r, line):
                r.chunk_times.append(trio.current_time())


def record_event(r: "StreamResult", event: str) -> bool:
    """Record one SSE event (``data: ...``) in ``r``; True if it added a content chunk."""
    if not event.startswith("data: "):
        return False
    data = event[len("data: "):]
    if data == "[DONE]":
        r.done = True
        return False
    obj = json.loads(data)
    if obj.get("usage"):
        r.usage = obj["usage"]
    if "error" in obj:
        r.error = obj["error"]
    elif obj.get("choices"):
        r.chunks.append(obj)
        return True
    return False


# ------------------------------------------------------------------ raw sockets


def request_bytes(port: int, body: dict[str, Any], path: str = "/v1/completions") -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode() + payload


async def open_raw(port: int, body: dict[str, Any], rcvbuf: int | None = None) -> trio.SocketStream:
    """Connect (with a tiny receive buffer if asked, set before connect so the window stays small)
    and send one request. The caller reads the answer at whatever pace it likes."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(request_bytes(port, body))
    return stream


async def read_response(stream: trio.SocketStream) -> bytes:
    """Read one whole answer: up to the end of a chunked body, the Content-Length, or EOF."""
    raw = bytearray()
    while data := await stream.receive_some(1 << 16):
        raw += data
        head, sep, body = raw.partition(b"\r\n\r\n")
        if not sep:
            continue
        lowered = head.lower()
        if b"transfer-encoding: chunked" in lowered:
            if body.endswith(b"\r\n0\r\n\r\n") or body == b"0\r\n\r\n":
                break
        elif b"content-length:" in lowered:
            length = int(lowered.split(b"content-length:")[1].split(b"\r\n")[0])
            if len(body) >= length:
                break
    return bytes(raw)


def parse_raw_sse(raw: bytes) -> StreamResult:
    """Status and SSE frames of a complete raw HTTP/1.1 answer (chunked transfer encoding)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    r = StreamResult(status=int(lines[0].split()[1]))
    r.headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    body = bytearray()
    if r.headers.get("transfer-encoding") == "chunked":
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            body += rest[:size]
            rest = rest[size + 2:]
    else:
        body += rest
    if r.status != 200:
        r.error = json.loads(body)["error"]
        return r
    for event in bytes(body).decode().split("\n\n"):
        record_event(r, event)
    return r


# ------------------------------------------------------------------ metrics


def reason_count(metrics: dict[str, float], name: str, reason: str, model: str = "tidal-tiny") -> float:
    """A counter labelled by reason, e.g. ``reason_count(m, "tidal:requests_rejected_total", "queue_full")``."""
    return metrics.get(f'{name}{{model_name="{model}",reason="{reason}"}}', 0.0)


def rejected(metrics: dict[str, float], reason: str) -> float:
    return reason_count(metrics, "tidal:requests_rejected_total", reason)


def aborted(metrics: dict[str, float], reason: str) -> float:
    return reason_count(metrics, "tidal:requests_aborted_total", reason)


async def metrics_async(server) -> dict[str, float]:
    """``server.metrics()`` without blocking the test's event loop."""
    return await trio.to_thread.run_sync(server.metrics)


async def wait_for_async(server, predicate, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics from a thread until ``predicate(metrics)`` holds."""
    with trio.fail_after(timeout):
        while True:
            m = await metrics_async(server)
            if predicate(m):
                return m
            await trio.sleep(0.02)
