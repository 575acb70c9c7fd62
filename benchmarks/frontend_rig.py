"""An in-process frontend with B streaming requests open and no engine process, for the output-path
benchmarks (frontend_path.py, frontend_direct.py): what they measure starts where this ends."""

from __future__ import annotations

import math

from tidal.config import ServerConfig
from tidal.engines.client import EngineClient
from tidal.registry.frontend import Frontend
from tidal.observe.metrics import Metrics
from tidal.wire import (
    EngineConfig,
    EngineStats,
    RequestOutput,
    SamplingParams,
    StepReport,
)


def open_streams(batch: int):
    """(engine client, frontend, requests, their ids): B requests admitted and scheduled, each with a
    first token delivered, so their readers are past the first-token wait."""
    config = ServerConfig(engine=EngineConfig(model="m", max_num_seqs=batch))
    engine = EngineClient(config.engine, channel_capacity=math.inf)
    engine.ready = object()  # type: ignore[assignment]  # healthy, no process: what it sends stays queued
    frontend = Frontend(config, engine, Metrics("m"), max_num_seqs=batch)
    requests = [frontend.open_request([1, 2, 3], SamplingParams(max_tokens=10**7), 0) for _ in range(batch)]
    ids = [r.request_id for r in requests]
    engine._handle(StepReport(ids, [RequestOutput(i, [5], "a") for i in ids], [], EngineStats()))
    return engine, frontend, requests, ids
