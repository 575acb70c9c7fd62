"""Frames sent from the engine reader task (``EventStream._offer``), down to the socket's edge.

A stream that keeps up has its frames written by the frontend's reader task the moment the
report is decoded; the live tests cannot make the kernel take only part of a frame, so these
drive the real pieces (Frontend, Mailbox, OutputReader, EventStream, BodyWriter over a real h11
connection in its chunked body and a real socket pair) in-process, with no engine behind them.
"""

from __future__ import annotations

import json
import math
import socket
from types import SimpleNamespace

import h11
import pytest
import trio
import trio.testing
from h11._writers import ChunkedWriter

from engines.single_engine import SingleEngine
from tidal.config import ServerConfig
from tidal.engines.client import EngineClient
from tidal.http.fast_send import BodyWriter
from tidal.registry.frontend import Frontend
from tidal.observe.metrics import Metrics
from tidal.openai.encoding import ChatRenderer, ChunkEncoder, sse
from tidal.service.reader import OutputReader
from tidal.service.stream import EventStream
from tidal.wire import EngineConfig, EngineStats, RequestOutput, SamplingParams, StepReport


def chunked_body_connection() -> h11.Connection:
    """A server-side h11 connection that has sent the headers of a chunked 200 response."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
    connection.next_event()
    connection.next_event()
    connection.send(h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]))
    assert connection.our_state is h11.SEND_BODY
    return connection


def read_chunks(data: bytes) -> list[bytes]:
    chunks = []
    while data:
        size_line, data = data.split(b"\r\n", 1)
        size = int(size_line, 16)
        chunks.append(data[:size])
        assert data[size:size + 2] == b"\r\n"
        data = data[size + 2:]
    return chunks


@pytest.fixture
def stream():
    server_sock, client_sock = socket.socketpair()
    server_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server_sock.setblocking(False)
    yield server_sock, client_sock
    server_sock.close()
    client_sock.close()


async def open_stream(server_sock):
    config = ServerConfig(engine=EngineConfig(model="m", max_num_seqs=4))
    engine = EngineClient(config.engine, channel_capacity=math.inf)
    engine.ready = object()  # healthy, no process: what it sends stays queued
    frontend = Frontend(config, SingleEngine(engine), Metrics("m"), max_num_seqs=4)  # type: ignore[arg-type]
    request = frontend.open_request([1, 2, 3], SamplingParams(max_tokens=100), 0)
    rid = request.request_id
    engine._handle(StepReport([rid], [RequestOutput(rid, [5], "first")], [], EngineStats()))
    reader = OutputReader(frontend, request, await request.mailbox.take(), 1)
    h11_protocol = SimpleNamespace(connection=chunked_body_connection())
    server = SimpleNamespace(send_lock=trio.Lock(), protocol=None)
    writer = BodyWriter(server, server_sock, h11_protocol, h11.SEND_BODY, ChunkedWriter)
    body = EventStream(reader, ChatRenderer(ChunkEncoder("completions", "m"), False), writer)
    return engine, request, body


async def drain(body: EventStream, frames: list[bytes] | None = None) -> None:
    async for frame in body:  # only the frames the ASGI path would send come back here
        if frames is not None:
            frames.append(frame)


def texts(chunks: list[bytes]) -> list[str]:
    out = []
    for chunk in chunks:
        for event in chunk.split(b"\n\n"):
            if event.startswith(b"data: {"):
                out.append(json.loads(event[6:])["choices"][0]["text"])
    return out


async def test_a_caught_up_stream_gets_its_frames_from_the_report_without_waking_its_task(stream):
    server_sock, client_sock = stream
    engine, request, body = await open_stream(server_sock)
    rid = request.request_id
    frames: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = trio.current_time() + 10  # a lost frame fails, not hangs
        nursery.start_soon(drain, body, frames)
        await trio.testing.wait_all_tasks_blocked()
        assert request.mailbox.direct is not None  # waiting, caught up: direct mode
        for piece in [" a", " b", " c"]:
            engine._handle(StepReport([], [RequestOutput(rid, [6], piece)], [], EngineStats()))
            # sent during _handle itself: the bytes are in the socket before any task ran
            assert texts(read_chunks(client_sock.recv(65536)))[-1] == piece
        assert not request.mailbox.has_pending and body.reader.num_tokens == 4
        engine._handle(StepReport([], [RequestOutput(rid, [7], " end", "length")], [], EngineStats()))
    assert frames == []  # every frame went straight to the socket
    final = read_chunks(client_sock.recv(65536))
    assert texts(final) == [" end"] and final[-1].endswith(b"data: [DONE]\n\n")
    assert body.reader.finish_reason == "length" and body.reader.usage()["completion_tokens"] == 5


async def test_a_frame_the_socket_takes_only_in_part_is_finished_before_the_next_one(stream):
    server_sock, client_sock = stream
    engine, request, body = await open_stream(server_sock)
    rid = request.request_id
    big = "x" * 300_000  # far more than the socket buffers hold
    received = bytearray()

    async def read_until(done) -> None:
        while not done():
            await trio.lowlevel.wait_readable(client_sock)
            received.extend(client_sock.recv(1 << 20))

    async with trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = trio.current_time() + 10  # a lost tail fails, not hangs
        nursery.start_soon(drain, body)
        await trio.testing.wait_all_tasks_blocked()
        engine._handle(StepReport([], [RequestOutput(rid, [6], big)], [], EngineStats()))
        assert body._unsent  # the kernel took the head of the frame; the body's task owns the tail
        assert request.mailbox.direct is None  # and nothing else goes direct until the tail is out
        engine._handle(StepReport([], [RequestOutput(rid, [7], " after")], [], EngineStats()))
        assert request.mailbox.has_pending  # queued behind the tail
        # the client reads: the task finishes the frame, then sends the next
        await read_until(lambda: len(received) > len(big))
        engine._handle(StepReport([], [RequestOutput(rid, [8], "", "stop")], [], EngineStats()))
        await read_until(lambda: received.endswith(b"data: [DONE]\n\n\r\n"))
    assert not nursery.cancel_scope.cancelled_caught
    sent = texts(read_chunks(bytes(received)))
    assert sent[:3] == ["first", big, " after"] and "".join(sent) == "first" + big + " after"
    assert body.reader.finish_reason == "stop" and body.reader.usage()["completion_tokens"] == 4


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_the_direct_frame_is_the_bytes_of_the_ordinary_one(kind):
    """``_offer`` builds its frames with ``content_frame``; the task path with ``chunk_json``."""
    texts = ["Hello", " wor\"ld\\", "\n\t", "é — 漢字 🙂", "\u0000\u001f", "</script>"]
    direct = ChunkEncoder(kind, "m")
    ordinary = ChunkEncoder(kind, "m", 0, same_response_as=direct)  # same id and time
    for text in texts:
        assert direct.content_frame(text) == sse(ordinary.chunk_json(text, None))
