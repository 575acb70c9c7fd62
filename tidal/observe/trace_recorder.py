"""Where a request's timeline goes when it ends: the hop histograms always, a span when tracing is on.

``Frontend.close`` (every admitted request passes it, however it ends) calls ``finish`` once per
request; frames written call ``first_frame`` / the ``observe_gap`` of their timeline. With
``--otlp-traces-endpoint`` the span export (tidal/observe/otel.py) runs on the OpenTelemetry SDK's batch
thread: ``finish`` only hands it the finished timeline.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from tidal.registry.lifecycle import ActiveRequest, RequestState
from tidal.observe.metrics import Metrics

if TYPE_CHECKING:
    from tidal.observe.timeline import Timeline


class SpanExporter(Protocol):
    def export(self, request: ActiveRequest, hops: list[tuple[str, float, float]]) -> None: ...

    def shutdown(self) -> None: ...


class TraceRecorder:
    def __init__(self, metrics: Metrics, exporter: SpanExporter | None = None):
        self.metrics = metrics
        self.exporter = exporter  # None: tracing off, nothing but the histograms
        self.observe_gap = metrics.itl_m.observe  # per frame written after the first

    def first_frame(self, timeline: "Timeline") -> None:
        self.metrics.ttft_m.observe(timeline.first_written - timeline.received)

    def finish(self, request: ActiveRequest) -> None:
        """The request is over for its handler: stamp its end, observe its hops, export its span."""
        timeline = request.timeline
        if timeline.ended:
            return
        finished = request.state is RequestState.FINISHED
        if finished and timeline.last_written:
            timeline.ended = timeline.last_written  # its final frame went to the socket then
        else:
            timeline.ended = time.monotonic()
            if finished and not timeline.num_frames:  # a whole (non-streamed) answer: its first token too
                self.metrics.ttft_m.observe(timeline.ended - timeline.received)
        hops = timeline.hops()
        observers = self.metrics.hop_m
        for hop, start, end in hops:
            observers[hop].observe(end - start)
        if self.exporter is not None:
            self.exporter.export(request, hops)
