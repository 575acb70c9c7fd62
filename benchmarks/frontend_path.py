"""Frontend CPU per token on the output path alone, in-process: no HTTP, no engine, no sockets.

    python benchmarks/frontend_path.py [BATCH] [STEPS]

One decoded ``StepReport`` frame per step, with one token for each of BATCH streaming requests,
goes the way the engine client's reader task sends it: ``EngineClient._handle`` ->
``Frontend.on_report`` -> each request's lifecycle, metrics and ``Mailbox`` -> its
``OutputReader`` -> ``SseBody`` frame bytes. Prints process CPU microseconds per token. It
isolates what issue 10 changed (hops 13-16 of docs/architecture.md) from the machine's noise in
the socket path, which ``frontend_cost.py`` includes.
"""

from __future__ import annotations

import sys
import time

import trio
from frontend_rig import open_streams

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


async def main(batch: int, steps: int) -> None:
    engine, frontend, requests, ids = open_streams(batch)
    bodies = []
    for request in requests:
        reader = OutputReader(frontend, request, await request.mailbox.take(), 1)
        bodies.append(SseBody(reader, ChunkEncoder("completions", "m"), False))
    frame = encode_frame(StepReport([], [RequestOutput(i, [5], " tok") for i in ids], [], EngineStats()))
    body = frame[HEADER_SIZE:]
    t0 = time.process_time()
    for _ in range(steps):
        engine._handle(decode_from_engine(body))
        for sse_body in bodies:
            await sse_body._next_frame()
    cpu = time.process_time() - t0
    print(f"batch {batch}: {1e6 * cpu / (steps * batch):.2f} us CPU per token")


if __name__ == "__main__":
    trio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 64, int(sys.argv[2]) if len(sys.argv) > 2 else 1500)
