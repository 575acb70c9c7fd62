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

import math
import sys
import time

import trio

from tidal.config import ServerConfig
from tidal.engine_client import EngineClient
from tidal.frontend import Frontend
from tidal.metrics import Metrics
from tidal.protocol import ChunkEncoder
from tidal.streaming import OutputReader, SseBody
from tidal.wire import (HEADER_SIZE, EngineConfig, EngineStats, RequestOutput, SamplingParams, StepReport,
                        decode_from_engine, encode_frame)


async def main(batch: int, steps: int) -> None:
    config = ServerConfig(engine=EngineConfig(model="m", max_num_seqs=batch))
    engine = EngineClient(config.engine, channel_capacity=math.inf)
    engine.ready = object()  # type: ignore[assignment]  # healthy, no process: what it sends stays queued
    frontend = Frontend(config, engine, Metrics("m"), max_num_seqs=batch)
    requests = [frontend.open_request([1, 2, 3], SamplingParams(max_tokens=10**7), 0) for _ in range(batch)]
    ids = [r.request_id for r in requests]
    engine._handle(StepReport(ids, [RequestOutput(i, [5], "a") for i in ids], [], EngineStats()))
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
