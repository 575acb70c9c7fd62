"""Client-side tools for the cancellation suite: a raw HTTP/1.1 client and step-clock helpers.

The raw client exists because the tests must decide *exactly* when a connection drops:
before the response head exists (request still queued), after N SSE events, or after
``[DONE]``. A plain socket gives that control and nothing in between buffers or retries.
"""

from __future__ import annotations

import json
import random
import socket
import time
from typing import Any

import httpx

from live_server import parse_metrics

MODEL = "tidal-tiny"
VOCAB_SIZE = 8192


def unique_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other test sends, so the prefix cache never shortens a prefill."""
    rng = random.Random(seed)
    return [rng.randrange(10, VOCAB_SIZE) for _ in range(length)]


def completion_body(prompt: Any, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}


# ------------------------------------------------------------------ metrics

# One client for every scrape: building an httpx client (its SSL context) costs 50+ ms on
# the shared machine, which is longer than a test step. No keep-alive, so no idle
# connection of ours ever holds up a server's graceful shutdown.
_http = httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0))


def scrape(server) -> dict[str, float]:
    """The server's /metrics now (about a millisecond)."""
    return parse_metrics(_http.get(server.url + "/metrics").text)


def scrape_health(server) -> int:
    """/health's status code."""
    return _http.get(server.url + "/health").status_code


def poll(server, predicate, timeout: float = 10.0, interval: float = 0.005) -> dict[str, float]:
    """Scrape until ``predicate(metrics)`` holds; return those metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(server)
        if predicate(m):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s; last metrics: "
                                 f"{ {k: v for k, v in m.items() if '{' not in k} }")
        time.sleep(interval)



def labelled(m: dict[str, float], name: str, **labels: str) -> float:
    """A labelled sample (0 if never incremented: prometheus-client omits untouched children)."""
    labels = {"model_name": MODEL, **labels}  # rendered sorted by label name
    return m.get(name + "{" + ",".join(f'{k}="{labels[k]}"' for k in sorted(labels)) + "}", 0.0)


def aborted(m: dict[str, float], reason: str) -> float:
    return labelled(m, "tidal:requests_aborted_total", reason=reason)


def aborts_freed(m: dict[str, float], steps: str) -> float:
    """Aborts whose blocks the engine freed ``steps`` ("0", "1", "2", "3+") steps after the abort
    arrived there: the guarantee as the engine keeps it (docs/cancellation.md)."""
    return labelled(m, "tidal:engine_aborts_freed_total", steps=steps)


def all_aborts(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("tidal:requests_aborted_total{"))


def steps(m: dict[str, float]) -> int:
    return int(m["tidal:engine_steps_total"])


def wait_blocks_free(server, timeout: float = 10.0) -> tuple[dict[str, float], float]:
    """Poll /metrics until no KV block is held; return (those metrics, seconds waited).

    Blocks and the step count in one scrape come from the same engine report, so
    ``steps(metrics)`` is the step whose report first showed the blocks free.
    """
    started = time.monotonic()
    m = poll(server, lambda m: m["tidal:kv_cache_blocks_used"] == 0, timeout)
    return m, time.monotonic() - started


# ------------------------------------------------------------------ a raw HTTP/1.1 client


def post_bytes(port: int, path: str, body: dict[str, Any]) -> bytes:
    """A complete HTTP/1.1 POST with a JSON body."""
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    return head + payload


class RawHttp:
    """One POST over a plain socket, read as the test chooses, dropped when the test says.

    ``next_event()`` returns the payload of the next SSE ``data:`` event (JSON text or
    ``[DONE]``); ``read_json()`` reads a whole non-streaming body. Chunked transfer
    encoding is decoded here; nothing is buffered beyond what the kernel received.
    """

    def __init__(self, port: int, path: str, body: dict[str, Any], timeout: float = 30.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.sendall(post_bytes(port, path, body))
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self._raw = b""  # received, not yet de-chunked
        self._body = b""  # de-chunked, not yet consumed
        self._chunked = False
        self._complete = False  # the terminal chunk (or Content-Length bytes) arrived
        self._eof = False

    def __enter__(self) -> "RawHttp":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop the connection (a FIN, or an RST if unread bytes are pending: both are a disconnect)."""
        self.sock.close()

    def settimeout(self, seconds: float) -> None:
        self.sock.settimeout(seconds)

    def _receive(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            self._eof = True
        self._raw += data

    def read_head(self) -> int:
        while b"\r\n\r\n" not in self._raw:
            if self._eof:
                raise EOFError("connection closed before a response head")
            self._receive()
        head, self._raw = self._raw.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        self._chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        return self.status

    def _dechunk(self) -> None:
        if not self._chunked:
            self._body += self._raw
            self._raw = b""
            length = self.headers.get("content-length")
            if length is not None and len(self._body) >= int(length):
                self._complete = True
            return
        while not self._complete:
            end = self._raw.find(b"\r\n")
            if end < 0:
                return
            size = int(self._raw[:end].split(b";")[0], 16)
            if len(self._raw) < end + 2 + size + 2:
                return
            self._body += self._raw[end + 2 : end + 2 + size]
            self._raw = self._raw[end + 4 + size :]
            self._complete = size == 0

    def next_event(self) -> str:
        """The next SSE event's data. Raises EOFError if the body ends first."""
        if self.status is None and self.read_head() != 200:
            raise AssertionError(f"expected a 200 stream, got {self.status}: {self.read_json()}")
        while True:
            self._dechunk()
            if b"\n\n" in self._body:
                event, self._body = self._body.split(b"\n\n", 1)
                return event.decode().removeprefix("data: ")
            if self._complete or self._eof:
                raise EOFError(f"stream ended without another event (left: {self._body!r})")
            self._receive()

    def next_chunk(self) -> dict[str, Any]:
        """The next event, parsed as JSON (fails on [DONE])."""
        return json.loads(self.next_event())

    def rest_of_stream(self) -> list[str]:
        """Every remaining event up to and including ``[DONE]``."""
        events = []
        while not events or events[-1] != "[DONE]":
            events.append(self.next_event())
        return events

    def read_json(self) -> Any:
        """The whole (non-streaming) response body, parsed."""
        if self.status is None:
            self.read_head()
        while True:
            self._dechunk()
            if self._complete or self._eof:
                return json.loads(self._body)
            self._receive()


def finish_reasons(events: list[str]) -> list[str | None]:
    """The finish_reason of every completion chunk among SSE event payloads."""
    reasons = []
    for event in events:
        if event == "[DONE]":
            continue
        data = json.loads(event)
        if "choices" in data and data["choices"]:
            reasons.append(data["choices"][0].get("finish_reason"))
    return reasons
