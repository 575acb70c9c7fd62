"""The request registry: admission, the per-request lifecycle, and where aborts start.

Hops owned here: ``open_request`` admits a request (or refuses it with a 503 before any
byte is sent) and hands it to the engine client; ``first_output`` waits for the engine
to schedule it and produce something, under ``--max-queue-wait``; ``close`` ends it.

``close`` is the one place an abort starts. It is synchronous (``abort_nowait``), so it
works from a cancelled scope, and it is idempotent. Every HTTP request and WebSocket
connection runs inside a ``RequestScope`` (see ``request_scope_middleware``) whose exit
closes every request opened in it, so no request outlives the task that opened it, even
if the handler is cancelled before its response body ever starts.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import math
import time

import trio

from tidal.config import ServerConfig
from tidal.engine_client import EngineClient, EngineDead, Route
from tidal.lifecycle import ActiveRequest, RequestState
from tidal.mailbox import Mailbox
from tidal.metrics import Metrics
from tidal.protocol import ApiError
from tidal.wire import AddRequest, RequestOutput, SamplingParams

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


class ShutdownAbort(Exception):
    """The server is shutting down: the stream ends with finish_reason "abort"."""


def engine_unavailable(why: str) -> ApiError:
    return ApiError(503, f"The engine is not available: {why}", "engine_error", None, 503)


# ------------------------------------------------------------------ request scopes

_scope: contextvars.ContextVar[list[ActiveRequest] | None] = contextvars.ContextVar("tidal_scope", default=None)


def request_scope_middleware(app, frontend_getter):
    """ASGI wrapper: every HTTP request / WebSocket connection is one scope of requests."""

    async def asgi(scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await app(scope, receive, send)
        opened: list[ActiveRequest] = []
        token = _scope.set(opened)
        if scope["type"] == "http":
            send = _shield_final_send(send)
        try:
            await app(scope, receive, send)
        finally:
            _scope.reset(token)
            frontend = frontend_getter()
            for request in opened:
                frontend.close(request, "client_disconnect")

    return asgi


def _shield_final_send(send):
    """Send a response's last message shielded from cancellation.

    When a response is answered before its request body was read (401, 404, 405, 413),
    hypercorn closes the connection from inside this send; quart-trio cancels the task as
    soon as its body reader sees the disconnect, which interrupted that close half-way and
    left the connection open and silent: the client's next request on it hung forever.
    (hypercorn already shields the socket write itself, so this adds no new blocking.)
    """

    async def shielded(message):
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            with trio.CancelScope(shield=True):
                return await send(message)
        return await send(message)

    return shielded


# ------------------------------------------------------------------ the registry


class Frontend:
    def __init__(self, config: ServerConfig, engine: EngineClient, metrics: Metrics, max_num_seqs: int):
        self.config = config
        self.engine = engine
        self.metrics = metrics
        self.max_num_seqs = max_num_seqs
        self.by_priority = config.engine.scheduling_policy == "priority"
        self.active: dict[int, ActiveRequest] = {}
        self.queued: set[ActiveRequest] = set()  # admitted, not yet scheduled by the engine
        self.num_running = 0  # scheduled, not yet finished (the frontend's view)
        self.draining = False
        self._ids = itertools.count(1)
        self._idle = trio.Event()
        self._idle.set()
        self._last_backlog_warning = 0.0

    # ------------------------------------------------------------------ admission

    def _queue_capacity(self) -> float:
        # Free engine slots are not "queue": with --max-num-seqs 2 --max-queued-requests 2 four
        # requests are admitted (two run, two wait) and the fifth is refused.
        return self.config.max_queued_requests + max(0, self.max_num_seqs - self.num_running)

    def _admit(self, priority: int, arrival: tuple) -> ActiveRequest | None:
        """Make room for a request; return a queued request to evict, or raise 503."""
        if len(self.queued) < self._queue_capacity():
            return None
        if self.by_priority and self.queued:
            victim = max(self.queued, key=lambda r: r.urgency)
            if arrival < victim.urgency:
                return victim
        self.metrics.rejected.labels(self.metrics.model_name, "queue_full").inc()
        raise service_unavailable(QUEUE_FULL)

    def open_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int) -> ActiveRequest:
        """Admit a request and send it to the engine, or raise an ApiError (503).

        Synchronous: nothing can be cancelled half-way. The request is closed when the
        enclosing RequestScope ends, if nobody closed it before.
        """
        if self.draining:
            self.metrics.rejected.labels(self.metrics.model_name, "shutdown").inc()
            raise service_unavailable(SHUTTING_DOWN)
        if not self.engine.healthy:
            raise engine_unavailable(self.engine.dead or "still starting")
        now = trio.current_time()
        order = next(self._ids)
        victim = self._admit(priority, (priority, now, order))
        request = ActiveRequest(
            request_id=order,
            priority=priority,
            arrival_time=now,
            arrival_order=order,
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            mailbox=Mailbox(self.config.max_stream_buffer_bytes),
        )
        route = Route(
            mailbox=request.mailbox,
            on_started=lambda: self._on_started(request),
            on_output=lambda output: self._on_output(request, output),
            on_overflow=lambda: self.abort(request, "slow_client",
                                           SlowClient("more than --max-stream-buffer-bytes undelivered")),
        )
        self.engine.submit_nowait(
            AddRequest(request.request_id, prompt_token_ids, params, priority, time.time()), route)
        self.active[request.request_id] = request
        self.queued.add(request)
        if len(self.active) == 1:
            self._idle = trio.Event()
        self.metrics.prompt_tokens_m.inc(len(prompt_token_ids))
        opened = _scope.get()
        if opened is not None:
            opened.append(request)
        if victim is not None:
            self.reject(victim, "preempted_by_priority", service_unavailable(EVICTED))
        return request

    async def first_output(self, request: ActiveRequest) -> RequestOutput:
        """Wait until the engine produced the request's first output.

        Raises the ApiError that ended the request early (queue timeout, eviction, slow
        client, engine failure). Cancellation leaves the request open; its scope closes it.
        """
        wait = self.config.max_queue_wait
        with trio.CancelScope() as scope:
            if wait is not None and request.state is RequestState.QUEUED:
                scope.deadline = request.arrival_time + wait
            request.queue_scope = scope
            try:
                first = await request.mailbox.take()
                self.note_backlog(request)
                return first
            except EngineDead as exc:
                self.abort(request, "engine_error")  # else its scope counts it as a client disconnect
                raise engine_unavailable(str(exc)) from None
            finally:
                request.queue_scope = None
        error = service_unavailable(QUEUE_TIMEOUT)
        self.reject(request, "queue_timeout", error)
        raise error

    # ------------------------------------------------------------------ engine events (demultiplexer)

    def _on_started(self, request: ActiveRequest) -> None:
        if request.state is not RequestState.QUEUED:
            return
        request.move_to(RequestState.RUNNING)
        self.queued.discard(request)
        self.num_running += 1
        if request.queue_scope is not None:
            request.queue_scope.deadline = math.inf  # it left the queue in time
        self.metrics.queue_time_m.observe(trio.current_time() - request.arrival_time)

    def _on_output(self, request: ActiveRequest, output: RequestOutput) -> None:
        now = trio.current_time()
        m = self.metrics
        if request.first_output_time is None:
            request.first_output_time = now
            m.ttft_m.observe(now - request.arrival_time)
        else:
            m.itl_m.observe(now - request.last_output_time)
        request.last_output_time = now
        n = len(output.token_ids)
        request.num_output_tokens += n
        m.generation_tokens_m.inc(n)
        if output.finish_reason is not None and not request.is_final:
            if request.state is RequestState.QUEUED:
                self._on_started(request)
            request.move_to(RequestState.FINISHED)
            self._release(request)
            m.e2e_m.observe(now - request.arrival_time)
            m.finished.labels(m.model_name, output.finish_reason).inc()

    # ------------------------------------------------------------------ endings

    def _release(self, request: ActiveRequest) -> None:
        """Give back the request's admission slot (once)."""
        if request in self.queued:
            self.queued.discard(request)
        elif request.state is not RequestState.QUEUED and request.request_id in self.active:
            self.num_running -= 1
        self.active.pop(request.request_id, None)
        if not self.active:
            self._idle.set()

    def abort(self, request: ActiveRequest, reason: str, error: BaseException | None = None) -> None:
        """End a live request: the engine frees its blocks; its reader gets ``error`` (if any)."""
        self._end(request, RequestState.ABORTED, reason, self.metrics.aborted, error)

    def reject(self, request: ActiveRequest, reason: str, error: ApiError) -> None:
        """Refuse a queued request with a 503 (it never produced a byte)."""
        self._end(request, RequestState.REJECTED, reason, self.metrics.rejected, error)

    def _end(self, request: ActiveRequest, state: RequestState, reason: str, counter,
             error: BaseException | None) -> None:
        if request.is_final:
            return
        request.move_to(state)
        request.abort_reason = reason
        self.engine.abort_nowait(request.request_id)
        self._release(request)
        counter.labels(self.metrics.model_name, reason).inc()
        if error is not None:
            request.mailbox.close(error, discard=True)

    def close(self, request: ActiveRequest, reason: str = "client_disconnect") -> None:
        """The handler is done with the request. Aborts it if the engine is still working on it."""
        if not request.is_final:
            self.abort(request, reason)

    def note_backlog(self, request: ActiveRequest) -> None:
        """Count outputs merged because the reader was behind; warn (rate-limited) on big backlogs."""
        backlog = request.mailbox.last_backlog
        if backlog > 1:
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
            for request in list(self.active.values()):
                mailbox = request.mailbox
                if mailbox.has_pending and now - mailbox.last_take_time > timeout:
                    log.warning("request %d: client took no bytes for %.1f s; aborting it as a slow client",
                                request.request_id, now - mailbox.last_take_time)
                    self.abort(request, "slow_client", SlowClient("stalled past --stream-stall-timeout"))

    async def drain(self, timeout: float) -> None:
        """Stop admitting; let requests finish for ``timeout`` s; then abort the rest."""
        self.draining = True
        with trio.move_on_after(timeout):
            await self._idle.wait()
        remaining = list(self.active.values())
        if remaining:
            log.warning("shutdown: aborting %d requests still in flight", len(remaining))
        for request in remaining:
            self.abort(request, "shutdown", ShutdownAbort())
