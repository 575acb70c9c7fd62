"""One request's clock, from its first byte in to its last frame out: the stamps of every hop.

A ``Timeline`` starts when the request's first byte is read (HTTP: hypercorn's read of it, see
``fast_send.first_byte_time``; WebSocket: its message's arrival) and is owned by the request's
lifecycle record (``ActiveRequest.timeline``) once admitted. Stamps are ``time.monotonic()``
readings; the engine's (``wire.EngineTiming``) come with the request's first output on the same
clock. A stamp costs a float: nothing here allocates per token.

The hops, each named for what happens in it and ending at the stamp beside it::

    received ─parse─> parsed ─tokenize─> tokenized ─admit─> admitted ─enqueue─> queued
      ─pipe_in─> engine_received ─engine_queue─> scheduled ─prefill─> sampled
      ─report_out─> report_sent ─pipe_out─> report_received ─deliver─> delivered
      ─first_frame─> first_written ─stream─> end

A hop whose stamps a request never reached (refused, aborted, non-streaming) is left out, and the
last reached stamp runs to the end as ``end`` (or ``stream`` after the first frame), so the hops of
every request are contiguous: they add up to its duration exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.wire import EngineTiming

# (hop, the stamp that ends it), in order
HOPS: tuple[tuple[str, str], ...] = (
    ("parse", "parsed"),  # body read, JSON parsed and validated
    ("tokenize", "tokenized"),  # chat template + tokeniser
    ("admit", "admitted"),  # admission (queue bound, priority eviction)
    ("enqueue", "queued"),  # encoded into the writer task's channel
    ("pipe_in", "engine_received"),  # the writer task's wake-up and write, the pipe, the engine's reader thread
    ("engine_queue", "scheduled"),  # the engine's inbox and waiting list, until its first step
    ("prefill", "sampled"),  # every prefill chunk's pass, until its first token is read back
    ("report_out", "report_sent"),  # detokenise, build and write the step report
    ("pipe_out", "report_received"),  # through the pipe to the frontend's reader task
    ("deliver", "delivered"),  # the frontend routes it into the request's mailbox
    ("first_frame", "first_written"),  # the request task wakes, the 200 goes out, the first frame is written
)
TAIL_HOPS = ("stream", "end")  # after the first frame; or after the last stamp a request reached
HOP_NAMES = tuple(h for h, _ in HOPS) + TAIL_HOPS
# hops the engine process spends (its step loop's critical path); the rest are the frontend's or the pipes'
ENGINE_HOPS = frozenset({"engine_queue", "prefill", "report_out"})


class Timeline:
    """The stamps of one request (0.0: not reached). Filled by the hop that reaches each one."""

    __slots__ = ("received", "parsed", "tokenized", "admitted", "queued", "engine", "report_sent",
                 "report_received", "delivered", "first_written", "last_written", "ended", "num_frames",
                 "max_backlog", "recorder", "traceparent", "operation")

    def __init__(self, received: float, traceparent: str | None = None):
        self.received = received
        self.parsed = self.tokenized = self.admitted = self.queued = 0.0
        self.engine: EngineTiming | None = None
        self.report_sent = self.report_received = self.delivered = 0.0
        self.first_written = self.last_written = self.ended = 0.0
        self.num_frames = 0  # content frames handed to the socket
        self.max_backlog = 0  # most engine outputs one delivery coalesced
        self.recorder = None  # the TraceRecorder that observes frames written (set at admission)
        self.traceparent = traceparent  # the caller's W3C trace context, if it sent one
        self.operation = "chat"  # the GenAI operation: "chat" or "text_completion"

    def fork(self) -> "Timeline":
        """Another choice's timeline (n > 1): the same front stamps, its own from admission on."""
        other = Timeline(self.received, self.traceparent)
        other.parsed, other.tokenized, other.operation = self.parsed, self.tokenized, self.operation
        return other

    def first_output(self, timing: "EngineTiming | None", report_sent: float, report_received: float,
                     delivered: float) -> None:
        """The stamps that came with (or met) the request's first output."""
        self.engine = timing
        self.report_sent = report_sent
        self.report_received = report_received
        self.delivered = delivered

    def wrote(self, now: float) -> float:
        """A content frame was handed to the socket at ``now``; the gap since the previous one (0.0 for
        the first)."""
        last = self.last_written
        self.last_written = now
        self.num_frames += 1
        if not last:
            self.first_written = now
            recorder = self.recorder
            if recorder is not None:
                recorder.first_frame(self)
            return 0.0
        recorder = self.recorder
        if recorder is not None:
            recorder.observe_gap(now - last)
        return now - last

    def stamp(self, name: str) -> float:
        """A stamp by its name in ``HOPS`` (engine ones included); 0.0 if not reached."""
        engine = self.engine
        if name == "engine_received":
            return engine.received_at if engine is not None else 0.0
        if name == "scheduled":
            return engine.scheduled_at if engine is not None else 0.0
        if name == "sampled":
            return engine.sampled_at if engine is not None else 0.0
        return getattr(self, name)

    def hops(self, end: float | None = None) -> list[tuple[str, float, float]]:
        """(hop, start, end) of every hop reached, contiguous from ``received`` to ``end`` (default: the
        request's end). A stamp earlier than the one before it (it cannot be, on one clock, but a
        merged report's stamp may tie) is taken as that one: hops are never negative."""
        end = self.ended if end is None else end
        out = []
        start = self.received
        for hop, name in HOPS:
            at = self.stamp(name)
            if not at:
                continue
            at = max(at, start)
            out.append((hop, start, at))
            start = at
        if end:
            out.append(("stream" if self.first_written else "end", start, max(end, start)))
        return out

    @property
    def prefill_chunks(self) -> list[float]:
        return self.engine.prefill_chunks if self.engine is not None else []
