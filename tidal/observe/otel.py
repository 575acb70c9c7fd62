"""Request spans over OTLP/HTTP (``--otlp-traces-endpoint``, vLLM's flag): one span per request, a
child span per hop of its timeline (tidal/observe/timeline.py).

Imported only when tracing is on, so tracing off costs nothing (not even the SDK's import).
``TraceRecorder.finish`` calls ``export`` once per request on the event loop: it builds the spans
from the timeline's stamps (start and end times given, nothing timed here) and hands them to the
SDK's ``BatchSpanProcessor``, whose thread encodes and posts them. The queue is bounded: a request
whose spans do not fit is dropped whole and counted (``tidal:trace_spans_dropped_total``), as are
spans the collector did not take; an unreachable collector costs the event loop nothing.

Attributes follow the OpenTelemetry GenAI semantic conventions where they exist
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``gen_ai.response.finish_reasons``) plus tidal's own (``tidal.*``). A W3C ``traceparent`` (HTTP
header or WebSocket message field) makes the span a child of the caller's; a malformed one is
ignored (the span starts a new trace).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import requests
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tidal.registry.lifecycle import ActiveRequest, RequestState

MAX_QUEUED_SPANS = 8192  # spans waiting for the export thread; past it whole requests are dropped
EXPORT_BATCH = 512
EXPORT_DELAY_MS = 500
EXPORT_TIMEOUT_S = 2.0  # one POST, retries included: the export thread never waits longer per batch

_propagator = TraceContextTextMapPropagator()


MAX_COLLECTOR_ANSWER_BYTES = 64 << 10  # of a collector's answer; the exporter needs its status only


class BoundedAnswers(requests.Session):
    """The exporter's HTTP session, reading at most ``MAX_COLLECTOR_ANSWER_BYTES`` of an answer, as
    sent (never decompressed), for at most ``EXPORT_TIMEOUT_S`` (plus one read's timeout); the rest
    is dropped with the connection. A hostile or broken collector's endless answer costs nothing."""

    def request(self, method, url, **kwargs):  # type: ignore[override]
        kwargs["stream"] = True
        response = super().request(method, url, **kwargs)
        deadline = time.monotonic() + EXPORT_TIMEOUT_S
        kept = bytearray()
        try:
            while len(kept) < MAX_COLLECTOR_ANSWER_BYTES and time.monotonic() < deadline:
                data = response.raw.read(min(1 << 14, MAX_COLLECTOR_ANSWER_BYTES - len(kept)), decode_content=False)
                if not data:
                    break
                kept += data
        except Exception:  # a broken answer: its status is what the exporter reads
            pass
        finally:
            response._content = bytes(kept)
            response.close()  # not fully read: the connection is closed, not reused
        return response


class _Counted(SpanExporter):
    """The OTLP exporter, telling ``SpanExport`` how many spans left the queue and how many failed."""

    def __init__(self, inner: SpanExporter, owner: "SpanExport"):
        self.inner = inner
        self.owner = owner

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception:  # the SDK logs nothing useful more; the drop counter says it
            result = SpanExportResult.FAILURE
        self.owner._exported(len(spans), result is SpanExportResult.SUCCESS)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class SpanExport:
    """Builds each finished request's spans and queues them for the export thread."""

    def __init__(self, endpoint: str, model_name: str, on_dropped: Callable[[int], None],
                 max_queued_spans: int = MAX_QUEUED_SPANS, exporter: SpanExporter | None = None):
        self.model_name = model_name
        self.on_dropped = on_dropped
        self.max_queued_spans = max_queued_spans
        self._lock = threading.Lock()
        self._queued = 0  # spans handed to the processor and not yet exported (or failed)
        self.num_dropped = 0
        inner = exporter if exporter is not None else OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S,
                                                                       session=BoundedAnswers())
        self._processor = BatchSpanProcessor(_Counted(inner, self), max_queue_size=max_queued_spans,
                                             schedule_delay_millis=EXPORT_DELAY_MS,
                                             max_export_batch_size=EXPORT_BATCH,
                                             export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000))
        self._provider = TracerProvider(resource=Resource.create({"service.name": "tidal"}))
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("tidal")
        # the timeline's clock (time.monotonic) to OpenTelemetry's (Unix epoch, ns)
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._epoch_offset_ns

    def _exported(self, num_spans: int, ok: bool) -> None:
        with self._lock:
            self._queued -= num_spans
        if not ok:
            self._drop(num_spans)

    def _drop(self, num_spans: int) -> None:
        self.num_dropped += num_spans
        self.on_dropped(num_spans)

    def export(self, request: ActiveRequest, hops: list[tuple[str, float, float]]) -> None:
        num_spans = len(hops) + 1
        with self._lock:
            if self._queued + num_spans > self.max_queued_spans:
                full = True
            else:
                full = False
                self._queued += num_spans
        if full:
            self._drop(num_spans)
            return
        timeline = request.timeline
        parent = _propagator.extract({"traceparent": timeline.traceparent}) if timeline.traceparent else None
        tracer = self._tracer
        span = tracer.start_span(f"{timeline.operation} {self.model_name}", context=parent, kind=SpanKind.SERVER,
                                 start_time=self._ns(timeline.received), attributes=self._attributes(request))
        span.set_attribute("tidal.num_hops", len(hops))
        for name, start, end in hops:
            child = tracer.start_span(name, context=set_span_in_context(span), start_time=self._ns(start),
                                      attributes={"tidal.hop": name})
            if name == "prefill":
                for i, chunk in enumerate(timeline.prefill_chunks):
                    child.add_event("prefill_chunk", {"tidal.chunk": i}, timestamp=self._ns(chunk))
            child.end(end_time=self._ns(end))
        if request.state in (RequestState.ABORTED, RequestState.REJECTED):
            span.set_status(Status(StatusCode.ERROR, request.abort_reason or request.state.value))
        span.end(end_time=self._ns(timeline.ended))

    def _attributes(self, request: ActiveRequest) -> dict:
        timeline = request.timeline
        reader = request.reader  # the one owner of what the client was told (tidal/service/reader.py)
        attributes = {
            "gen_ai.operation.name": timeline.operation,
            "gen_ai.request.model": self.model_name,
            "gen_ai.response.model": self.model_name,
            "gen_ai.usage.input_tokens": request.num_prompt_tokens,
            "gen_ai.usage.output_tokens": reader.num_tokens if reader is not None else 0,
            "gen_ai.request.max_tokens": request.params.max_tokens,
            "gen_ai.request.temperature": request.params.temperature,
            "tidal.request_id": request.request_id,
            "tidal.state": request.state.value,
            "tidal.frames": timeline.num_frames,
            "tidal.max_backlog": timeline.max_backlog,
            "tidal.coalesced_outputs": request.mailbox.num_merged,
            "tidal.prefill_chunks": len(timeline.prefill_chunks),
        }
        if reader is not None and reader.finish_reason is not None:  # what the client was told
            attributes["gen_ai.response.finish_reasons"] = [reader.finish_reason]
        elif request.abort_reason is not None:
            attributes["gen_ai.response.finish_reasons"] = ["abort"]
        if request.abort_reason is not None:
            attributes["tidal.abort_reason"] = request.abort_reason
        if request.num_draft_tokens:  # speculative decoding: this request's proposals and their acceptance
            attributes["tidal.spec_draft_tokens"] = request.num_draft_tokens
            attributes["tidal.spec_accepted_tokens"] = request.num_accepted_tokens
            attributes["tidal.spec_acceptance_rate"] = request.num_accepted_tokens / request.num_draft_tokens
        if timeline.first_written:
            attributes["tidal.time_to_first_token_s"] = timeline.first_written - timeline.received
        return attributes

    def shutdown(self) -> None:
        """Flush what is queued (bounded by the export timeout) and stop the export thread."""
        self._provider.shutdown()

