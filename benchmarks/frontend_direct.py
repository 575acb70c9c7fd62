"""Frontend CPU per token on the caught-up streams' path, in-process, over real sockets.

    python benchmarks/frontend_direct.py [BATCH] [STEPS] [--tcp] [--profile]

BATCH streaming requests whose SSE body tasks have caught up (their mailboxes offer each output
to ``SseBody._offer``); every step one decoded ``StepReport`` with one token for each goes the
way the engine client's reader task sends it: ``EngineClient._handle`` -> ``Frontend.on_report``
-> lifecycle, metrics, ``Mailbox.put_nowait`` -> ``SseBody._offer`` -> ``ChunkEncoder.content_frame``
-> ``BodyWriter.send_now`` -> the kernel (a Unix socket pair, or loopback TCP with ``--tcp``; the
peers are drained between batches of 100 steps, outside the timing). Prints process CPU
(user, system) per token. This is the per-token part of the frontend's cost at c=64 in the
``vllm bench serve`` runs (frontend_side_by_side.py), without the HTTP requests around it, the
engine, or the noise of the client; ``--profile`` adds cProfile's table.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import resource
import socket
from types import SimpleNamespace

import h11
import trio
from frontend_rig import open_streams
from h11._writers import ChunkedWriter

from tidal.http.fast_send import BodyWriter
from tidal.openai.encoding import ChunkEncoder
from tidal.service.stream import OutputReader, SseBody
from tidal.wire import (
    HEADER_SIZE,
    EngineStats,
    RequestOutput,
    StepReport,
    decode_from_engine,
    encode_frame,
)


def chunked_body_connection() -> h11.Connection:
    """An h11 server connection in the chunked body of a response, as BodyWriter expects."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
    connection.next_event()
    connection.next_event()
    connection.send(h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]))
    return connection


def socket_pair(tcp: bool) -> tuple[socket.socket, socket.socket]:
    if tcp:
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            peer = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
        ours.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    else:
        ours, peer = socket.socketpair()
    for sock in (ours, peer):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
        sock.setblocking(False)
    return ours, peer


async def main(batch: int, steps: int, tcp: bool, profile: bool) -> None:
    engine, frontend, requests, ids = open_streams(batch)
    peers = []
    for request in requests:
        ours, peer = socket_pair(tcp)
        peers.append(peer)
        server = SimpleNamespace(send_lock=trio.Lock())
        writer = BodyWriter(server, ours, SimpleNamespace(connection=chunked_body_connection()), h11.SEND_BODY,
                            ChunkedWriter)
        body = SseBody(OutputReader(frontend, request, await request.mailbox.take(), 1),
                       ChunkEncoder("chat", "m"), False, writer)
        await body._next_frame()  # the first frame (with the role), as the body's task sends it
        request.mailbox.direct = body._offer  # what SseBody.__anext__ sets while it waits, caught up
    report = encode_frame(StepReport([], [RequestOutput(i, [5], " tok") for i in ids], [], EngineStats()))
    report = report[HEADER_SIZE:]
    profiler = cProfile.Profile() if profile else None
    user = system = 0.0
    done = 0
    while done < steps:
        n = min(100, steps - done)
        before = resource.getrusage(resource.RUSAGE_SELF)
        if profiler:
            profiler.enable()
        for _ in range(n):
            engine._handle(decode_from_engine(report))
        if profiler:
            profiler.disable()
        after = resource.getrusage(resource.RUSAGE_SELF)
        user += after.ru_utime - before.ru_utime
        system += after.ru_stime - before.ru_stime
        done += n
        for peer in peers:
            try:
                while peer.recv(1 << 20):
                    pass
            except BlockingIOError:
                pass
    assert all(r.mailbox.direct is not None and not r.mailbox.has_pending for r in requests), "left the direct path"
    tokens = steps * batch
    print(f"batch {batch} ({'tcp' if tcp else 'unix'}): {1e6 * (user + system) / tokens:.2f} us CPU per token "
          f"(user {1e6 * user / tokens:.2f}, sys {1e6 * system / tokens:.2f})")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("batch", type=int, nargs="?", default=64)
    ap.add_argument("steps", type=int, nargs="?", default=2000)
    ap.add_argument("--tcp", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    trio.run(main, args.batch, args.steps, args.tcp, args.profile)
