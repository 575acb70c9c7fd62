"""The request registry: admission, the per-request lifecycle, and where aborts start.

Hops owned here: ``open_request`` admits a request (or refuses it with a 503 before any
byte is sent) and hands it to the engine client the router picks (``ReplicaSet.pick``); ``on_report`` routes what the engine
reports to each request's lifecycle and mailbox; ``first_output`` waits for the engine to
schedule it and produce something, under ``--max-queue-wait``.

Every ending goes through ``_end``, the only code that moves a request to a final state
(``tidal/registry/lifecycle.py`` holds the table): FINISHED when the engine's final output arrives,
ABORTED or REJECTED when the frontend ends it (then it tells the engine to forget it). It
leaves the reader its last word in the mailbox: the final output, one with finish_reason
"abort", or an ``ApiError``. Readers never see engine or shutdown exceptions.

A handler never ends a request itself. Every HTTP request and WebSocket connection (and each
request multiplexed on one) runs inside a ``RequestScope`` (``open_request_scope``; the ASGI
wrapper ``http/request_scope.py``) whose ``RequestScope.close`` is the one place ``close`` is
called: at the scope's exit it aborts every request opened in the scope that is not over yet, so no
request outlives the task that opened it, even if the handler is cancelled before its response body
ever starts. The completion routes call it as soon as the client's disconnect arrives, before the
handler unwinds, so a disconnect's first act is its abort. ``close`` is synchronous
(``abort_nowait``), so it works from a cancelled scope, and idempotent.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import math
import time
from collections.abc import Iterator

import trio

from tidal.config import ServerConfig
from tidal.engines.client import EngineClient
from tidal.engines.replicas import ReplicaSet
from tidal.registry.lifecycle import ActiveRequest, RequestState, RequestTable
from tidal.registry.mailbox import Mailbox
from tidal.observe.metrics import Metrics
from tidal.observe.timeline import Timeline
from tidal.observe.trace_recorder import TraceRecorder
from tidal.errors import ApiError
from tidal.wire import AdapterSpec, AddRequest, RequestOutput, SamplingParams, StepReport

log = logging.getLogger("tidal.frontend")

QUEUE_FULL = "The request queue is full."
EVICTED = "The request is aborted by a higher priority request."
QUEUE_TIMEOUT = "Request waiting timeout reached."
SHUTTING_DOWN = "The server is shutting down."


def service_unavailable(message: str, retry_after: int = 1) -> ApiError:
    # Retry-After also tells the openai SDK how long to back off instead of hammering us.
    return ApiError(503, message, "service_unavailable", None, 503, {"Retry-After": str(retry_after)})


class SlowClient(ApiError):
    def __init__(self, why: str):
        super().__init__(503, f"The client did not read its stream fast enough ({why}); the request was aborted.",
                         "slow_client", None, 503)


def engine_unavailable(why: str) -> ApiError:
    return ApiError(503, f"The engine is not available: {why}", "engine_error", None, 503)


# ------------------------------------------------------------------ request scopes

class RequestScope:
    """The requests one handler opened, and why those still live at its exit end."""

    __slots__ = ("frontend", "opened", "close_reason")

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.opened: list[ActiveRequest] = []
        self.close_reason = "client_disconnect"  # a WebSocket "cancel" makes it "client_cancel"

    def close(self) -> None:
        """End every request opened here that is not over (the one caller of ``Frontend.close``).

        Called at the scope's exit, and earlier by whoever knows the client is gone before the
        handler has unwound (``completion_route._cancel_on_disconnect``): the abort is then the
        first thing a disconnect does, not something that waits for the handler's and other
        requests' unwinding. Idempotent: a request ends once."""
        for request in self.opened:
            self.frontend.close(request, self.close_reason)


def current_request_scope() -> RequestScope | None:
    """The innermost RequestScope of the calling task (tasks started inside a scope share it)."""
    return _scope.get()


_scope: contextvars.ContextVar[RequestScope | None] = contextvars.ContextVar("tidal_scope", default=None)


@contextlib.contextmanager
def open_request_scope(frontend: Frontend) -> Iterator[RequestScope]:
    """Every request ``open_request`` admits inside the block is closed when it exits, if it is not
    over before (``RequestScope.close``). Scopes nest: a request belongs to the innermost."""
    requests = RequestScope(frontend)
    token = _scope.set(requests)
    try:
        yield requests
    finally:
        _scope.reset(token)
        requests.close()


# ------------------------------------------------------------------ the registry


class Frontend:
    def __init__(self, config: ServerConfig, engine: ReplicaSet, metrics: Metrics, max_num_seqs: int,
                 recorder: TraceRecorder | None = None):
        self.config = config
        self.engine = engine
        self.metrics = metrics
        # publishes each request's timeline when it ends: hop histograms, and spans if tracing is on
        self.recorder = recorder if recorder is not None else TraceRecorder(metrics)
        self._report_stamps = (0.0, 0.0)
        self.max_num_seqs = max_num_seqs
        self.by_priority = config.engine.scheduling_policy == "priority"
        self.requests = RequestTable()
        self.draining = False
        self._ids = itertools.count(1)
        self._last_backlog_warning = 0.0
        engine.attach(self)

    @property
    def active(self) -> dict[int, ActiveRequest]:
        """The live requests by id (the lifecycle table's)."""
        return self.requests.live

    # ------------------------------------------------------------------ admission

    def _queue_capacity(self) -> float:
        # Free engine slots are not "queue": with --max-num-seqs 2 --max-queued-requests 2 four
        # requests are admitted (two run, two wait) and the fifth is refused.
        return self.config.max_queued_requests + max(0, self.max_num_seqs - self.requests.num_running)

    def _admit(self, priority: int, arrival: tuple) -> ActiveRequest | None:
        """Make room for a request; return a queued request to evict, or raise 503."""
        if self.requests.num_queued < self._queue_capacity():
            return None
        if self.by_priority and self.requests.num_queued:
            victim = max(self.requests.queued(), key=lambda r: r.urgency)
            if arrival < victim.urgency:
                return victim
        self.metrics.rejected.labels(self.metrics.model_name, "queue_full").inc()
        raise service_unavailable(QUEUE_FULL)

    def open_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                     fork_of: int | None = None, timeline: Timeline | None = None,
                     adapter: AdapterSpec | None = None) -> ActiveRequest:
        """Admit a request and send it to the engine, or raise an ApiError (503).

        ``timeline``: the request's clock since its first byte (a new one starts now if None).
        ``adapter``: the LoRA adapter it runs through (None: the base model).

        Synchronous: nothing can be cancelled half-way. The request is closed when the
        enclosing RequestScope ends, if it is not over before.
        """
        if self.draining:
            self.metrics.rejected.labels(self.metrics.model_name, "shutdown").inc()
            raise service_unavailable(SHUTTING_DOWN)
        engine = self.engine
        if not engine.healthy:
            raise engine_unavailable(engine.dead or "still starting")
        now = trio.current_time()
        request_id = next(self._ids)  # also the order of arrival (ties of the same instant)
        victim = self._admit(priority, (priority, now, request_id))
        engine = engine.pick(prompt_token_ids)  # the replica that will serve it soonest (tidal/engines/router.py)
        if timeline is None:
            timeline = Timeline(time.monotonic())
        timeline.admitted = time.monotonic()
        timeline.recorder = self.recorder
        request = ActiveRequest(
            request_id=request_id,
            priority=priority,
            arrival_time=now,
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            mailbox=Mailbox(self.config.max_stream_buffer_bytes),
            engine=engine,
            timeline=timeline,
            adapter=None if adapter is None else adapter.name,
        )
        engine.submit_nowait(AddRequest(request.request_id, prompt_token_ids, params, priority, now, fork_of,
                                        None if adapter is None else adapter.adapter_id))
        timeline.queued = time.monotonic()
        self.requests.add(request)
        self.metrics.prompt_tokens_m.inc(len(prompt_token_ids))
        requests = _scope.get()
        if requests is not None:
            requests.opened.append(request)
        if victim is not None:
            self.reject(victim, "preempted_by_priority", service_unavailable(EVICTED))
        return request

    def queue_deadline(self, request: ActiveRequest) -> float:
        """When a request still queued is refused for waiting too long (``--max-queue-wait``);
        infinity once it is scheduled, or with no bound."""
        wait = self.config.max_queue_wait
        if wait is not None and request.state is RequestState.QUEUED:
            return request.arrival_time + wait
        return math.inf

    async def first_output(self, request: ActiveRequest) -> RequestOutput:
        """Wait until the engine produced the request's first output.

        Raises the ApiError that ended the request early (queue timeout, eviction, slow
        client, engine failure, shutdown). Cancellation leaves the request open; its scope
        closes it.
        """
        with trio.CancelScope() as scope:
            scope.deadline = self.queue_deadline(request)
            request.queue_scope = scope
            try:
                first = await request.mailbox.take()
                self.note_backlog(request)
                return first
            finally:
                request.queue_scope = None
        error = service_unavailable(QUEUE_TIMEOUT)
        self.reject(request, "queue_timeout", error)
        raise error

    # ------------------------------------------------------------------ engine reports

    def on_report(self, report: StepReport, engine: EngineClient) -> None:
        """Route one engine step's events to the requests they name (the engine client's one door).

        Request ids are unique across engines, so ``engine`` is not needed to find a request.
        Events for a request that is no longer live (aborted, rejected) are dropped.
        """
        live = self.requests.live
        # for the timelines of first outputs (a stand-in engine in a test may not read a pipe)
        self._report_stamps = (report.sent_at, getattr(engine, "read_time", 0.0))
        for request_id in report.started:
            request = live.get(request_id)
            if request is not None and request.state is RequestState.QUEUED:
                self._start(request)
        now = trio.current_time()
        num_tokens = 0
        for output in report.outputs:
            request = live.get(output.request_id)
            if request is not None:
                num_tokens += len(output.token_ids)
                self._deliver(request, output, now)
        if num_tokens:
            self.metrics.generation_tokens_m.inc(num_tokens)  # once per report, not per request
        # report.finished needs nothing here: the engine forgets a request either after its
        # final output (handled above) or because the frontend aborted it (already final)

    def on_engine_dead(self, engine: EngineClient, why: str) -> None:
        """Fail every live request on ``engine``: its reader gets the error after what is pending."""
        error = engine_unavailable(why)
        for request in [r for r in self.requests.live.values() if r.engine is engine]:
            self._end(request, RequestState.ABORTED, "engine_error", self.metrics.aborted, error, discard=False)

    def _start(self, request: ActiveRequest) -> None:
        request.move_to(RequestState.RUNNING)
        if request.queue_scope is not None:
            request.queue_scope.deadline = math.inf  # it left the queue in time
        self.metrics.queue_time_m.observe(trio.current_time() - request.arrival_time)

    def _deliver(self, request: ActiveRequest, output: RequestOutput, now: float) -> None:
        if request.first_output_time is None:
            request.first_output_time = now
            self.metrics.first_output_m.observe(now - request.arrival_time)
            report_sent, report_received = self._report_stamps
            request.timeline.first_output(output.timing, report_sent, report_received, time.monotonic())
        else:
            self.metrics.inter_output_m.observe(now - request.last_output_time)
        request.last_output_time = now
        if output.num_draft_tokens:
            request.num_draft_tokens, request.num_accepted_tokens = output.num_draft_tokens, output.num_accepted_tokens
        if output.finish_reason is not None:
            if request.state is RequestState.QUEUED:
                self._start(request)
            self._end(request, RequestState.FINISHED, output.finish_reason, self.metrics.finished, output,
                      discard=False)
        elif not request.mailbox.put_nowait(output):
            self.abort(request, "slow_client", SlowClient("more than --max-stream-buffer-bytes undelivered"))

    # ------------------------------------------------------------------ endings

    def abort(self, request: ActiveRequest, reason: str, error: ApiError | None = None) -> None:
        """End a live request: the engine frees its blocks; its reader gets ``error``, else a
        final output with finish_reason "abort" (what was pending is dropped either way)."""
        self._end(request, RequestState.ABORTED, reason, self.metrics.aborted, error)

    def reject(self, request: ActiveRequest, reason: str, error: ApiError) -> None:
        """Refuse a queued request with a 503 (it never produced a byte)."""
        self._end(request, RequestState.REJECTED, reason, self.metrics.rejected, error)

    def _end(self, request: ActiveRequest, state: RequestState, reason: str, counter,
             ending: RequestOutput | ApiError | None, discard: bool = True) -> None:
        """Every ending, once: the final state, its count (by ``reason``), the engine told to forget
        the request unless it finished there, and the reader's last word: ``ending`` (the engine's
        final output, or an error), else a final output with finish_reason "abort"."""
        if request.is_final:
            return
        request.move_to(state)
        if state is RequestState.FINISHED:
            self.metrics.e2e_m.observe(trio.current_time() - request.arrival_time)
        else:
            request.abort_reason = reason
            request.engine.abort_nowait(request.request_id)
        counter.labels(self.metrics.model_name, reason).inc()
        if ending is None:
            ending = RequestOutput(request.request_id, [], "", "abort")
        request.mailbox.close(ending, discard)

    def close(self, request: ActiveRequest, reason: str = "client_disconnect") -> None:
        """The handler's scope is over, or its client is gone (``RequestScope.close``): abort the
        request unless it is over, then publish its timeline. The abort goes first."""
        self._end(request, RequestState.ABORTED, reason, self.metrics.aborted, None)
        self.recorder.finish(request)

    def note_backlog(self, request: ActiveRequest) -> None:
        """Count outputs merged because the reader was behind; warn (rate-limited) on big backlogs."""
        backlog = request.mailbox.last_backlog
        if backlog > 1:
            timeline = request.timeline
            if backlog > timeline.max_backlog:
                timeline.max_backlog = backlog
            self.metrics.coalesced_m.inc(backlog - 1)
            if backlog >= 20:
                now = time.monotonic()
                if now - self._last_backlog_warning > 10.0:
                    self._last_backlog_warning = now
                    log.warning("streaming backlog: request %d merged %d queued outputs into one frame "
                                "(the client or the event loop is behind)", request.request_id, backlog)

    # ------------------------------------------------------------------ background duties

    async def watch_stalls(self) -> None:
        """Abort requests whose client has not taken bytes for --stream-stall-timeout seconds."""
        timeout = self.config.stream_stall_timeout
        while True:
            await trio.sleep(min(1.0, timeout / 4))
            now = trio.current_time()
            for request in list(self.requests.live.values()):
                mailbox = request.mailbox
                if mailbox.has_pending and now - mailbox.last_take_time > timeout:
                    log.warning("request %d: client took no bytes for %.1f s; aborting it as a slow client",
                                request.request_id, now - mailbox.last_take_time)
                    self.abort(request, "slow_client", SlowClient("stalled past --stream-stall-timeout"))

    async def drain(self, timeout: float) -> None:
        """Stop admitting; let requests finish for ``timeout`` s; then end the rest.

        A request still queued is refused (503, it never produced a byte); a running one
        ends its stream with finish_reason "abort".
        """
        self.draining = True
        with trio.move_on_after(timeout):
            await self.requests.wait_idle()
        remaining = list(self.requests.live.values())
        if remaining:
            log.warning("shutdown: aborting %d requests still in flight", len(remaining))
        for request in remaining:
            if request.state is RequestState.QUEUED:
                self.reject(request, "shutdown", service_unavailable(SHUTTING_DOWN))
            else:
                self.abort(request, "shutdown")
