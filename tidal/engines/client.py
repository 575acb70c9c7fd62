"""The frontend's side of the process boundary: start, feed, read and watch the engine.

Hops owned here (see docs/architecture.md):

* frontend -> ``submit_nowait``/``abort_nowait`` -> bounded memory channel -> **writer task**
  -> engine stdin pipe. Neither call awaits, so an abort issued from a cancelled scope is
  never lost; the channel is sized so that admission bounds what can be in it.
* engine stdout pipe -> **reader task** -> each ``StepReport`` to ``listener.on_report``
  (the frontend, which routes outputs to requests; it never waits on a handler).
* **heartbeat task**: a Ping, answered by the engine's pipe reader thread with the step
  loop's progress (tidal/engines/liveness.py); no answer within the heartbeat timeout (of the
  frontend's own on-time waiting) means the engine is hung, and so does a step stuck far past
  what its size explains; EOF on the pipe means it died. Any of these: ``listener.on_engine_dead``
  is told at once and ``run`` raises ``EngineDead``.

Transport only: this module knows no requests. Several clients (data-parallel replicas) may
share one listener; each call names the client it comes from.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import subprocess
import sys
import time
from typing import Protocol

import trio

from tidal.engines.liveness import StepBound, wait_on_time
from tidal.wire import (
    AbortRequests,
    AdapterLoaded,
    AdapterSpec,
    AddRequest,
    EngineConfig,
    EngineFailed,
    EngineStats,
    FrameSplitter,
    LoadAdapter,
    Ping,
    Pong,
    Ready,
    Shutdown,
    StepProgress,
    StepReport,
    UnloadAdapter,
    decode_from_engine,
    encode_frame,
    engine_process_env,
)

log = logging.getLogger("tidal.engines.client")


class EngineDead(Exception):
    """The engine process died, hung or failed; requests in flight cannot finish."""


class EngineStartError(EngineDead):
    pass


class Listener(Protocol):
    """Who hears what the engine reports (the frontend). Called from the reader task; never awaits."""

    def on_report(self, report: StepReport, engine: "EngineClient") -> None: ...

    def on_engine_dead(self, engine: "EngineClient", why: str) -> None: ...


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        channel_capacity: float,
        heartbeat_interval: float = 1.0,
        heartbeat_timeout: float = 10.0,
        step_timeout: float = 600.0,
        start_timeout: float = 600.0,
    ):
        self.config = config
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.step_bound = StepBound(step_timeout)
        self.start_timeout = start_timeout
        self.listener: Listener | None = None
        self.ready: Ready | None = None
        self.stats = EngineStats()
        self.progress = StepProgress()  # as of the last Pong
        self.dead: str | None = None  # why, once the engine is gone
        self.process: trio.Process | None = None
        self._send, self._receive = trio.open_memory_channel(channel_capacity)
        self._nonces = itertools.count(1)
        self._pongs: dict[int, trio.Event] = {}
        self._adapter_answers: dict[int, AdapterLoaded | None] = {}  # adapter id -> its answer, once it came
        self._adapter_events: dict[int, trio.Event] = {}
        self.read_time = 0.0  # time.monotonic() of the last read from the engine: its reports' "report_received"

    # ------------------------------------------------------------------ requests

    def attach(self, listener: Listener) -> None:
        """Send every report (and the news of the engine's death) to ``listener`` from now on."""
        self.listener = listener

    def submit_nowait(self, message: AddRequest) -> None:
        """Queue the request for the engine. Never blocks.

        The frame is encoded here, in the caller's task: a request whose data cannot encode
        fails its own task, never the writer that every request shares.
        """
        if self.dead is not None:
            raise EngineDead(self.dead)
        self._send.send_nowait(encode_frame(message))

    def abort_nowait(self, request_id: int) -> None:
        """Tell the engine to free the request. Never blocks; no-op once the engine is gone.

        The caller sends it at most once per request, and only while the engine may still
        hold it (the lifecycle table knows).
        """
        if self.dead is None:
            self._send.send_nowait(encode_frame(AbortRequests([request_id])))

    async def ping(self, timeout: float) -> EngineStats | None:
        """Round trip to the engine process (its pipe reader thread, not its step loop); None if it
        does not answer within ``timeout`` seconds of this frontend's on-time waiting."""
        if self.dead is not None:
            return None
        nonce = next(self._nonces)
        event = self._pongs[nonce] = trio.Event()
        try:
            self._send.send_nowait(encode_frame(Ping(nonce)))
            return self.stats if await wait_on_time(event, timeout) and self.dead is None else None
        except trio.WouldBlock:
            return None
        finally:
            self._pongs.pop(nonce, None)

    async def load_adapter(self, spec: AdapterSpec, timeout: float) -> str | None:
        """Have the engine read and check a LoRA adapter; why it cannot be used, or None once it is loaded.
        (The registry sends one load at a time, so the channel's headroom holds it.)"""
        if self.dead is not None:
            return f"the engine is not available: {self.dead}"
        event = self._adapter_events[spec.adapter_id] = trio.Event()
        try:
            self._send.send_nowait(encode_frame(LoadAdapter(spec)))
            with trio.move_on_after(timeout):
                await event.wait()
            answer = self._adapter_answers.get(spec.adapter_id)
            if answer is None:
                return self.dead or f"the engine did not load the adapter within {timeout:g} s"
            return answer.error
        except trio.WouldBlock:
            return "the engine's request channel is full"
        finally:
            self._adapter_events.pop(spec.adapter_id, None)
            self._adapter_answers.pop(spec.adapter_id, None)

    def unload_adapter_nowait(self, adapter_id: int) -> None:
        """Tell the engine to forget an adapter no request uses; no-op once the engine is gone (or, rarely, when
        the channel is full: the engine then keeps a cold adapter it evicts when it needs the room)."""
        if self.dead is None:
            try:
                self._send.send_nowait(encode_frame(UnloadAdapter(adapter_id)))
            except trio.WouldBlock:
                log.warning("the engine channel is full: adapter %d stays registered in the engine", adapter_id)

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead is None

    # ------------------------------------------------------------------ lifetime

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start the engine process, report Ready via ``task_status``, serve until cancelled.

        On cancellation the engine is told to shut down and reaped. Raises ``EngineDead``
        if the engine exits, hangs or fails on its own.
        """
        env = engine_process_env(dict(os.environ))  # the OpenMP wait (tidal/wire.py); the user's wins
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "tidal.gpu"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            preexec_fn=_ignore_sigint,
        )
        self.process = process
        try:
            await process.stdin.send_all(encode_frame(self.config))
            splitter = FrameSplitter()
            with trio.fail_after(self.start_timeout):
                self.ready, leftover = await self._read_until_ready(process, splitter)
            log.info("engine ready (pid %d, %s, %s [%s], %d KV blocks of %d tokens, max_model_len %d)",
                     process.pid, self.ready.device, self.ready.dtype, self.ready.dtype_reason,
                     self.ready.num_total_blocks,
                     self.ready.block_size, self.ready.max_model_len)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop, process)
                nursery.start_soon(self._heartbeat_loop, process)
                task_status.started(self.ready)
                await self._read_loop(process, splitter, leftover)  # returns at EOF
                nursery.cancel_scope.cancel()
            raise EngineDead(self._fail(f"engine process exited (code {await process.wait()})"))
        except trio.TooSlowError:
            raise EngineStartError(self._fail(f"engine did not start within {self.start_timeout} s")) from None
        finally:
            with trio.CancelScope(shield=True):
                await self._stop_process(process)

    async def _read_until_ready(self, process: trio.Process, splitter: FrameSplitter) -> tuple[Ready, list[bytes]]:
        while True:
            data = await process.stdout.receive_some(1 << 16)
            if not data:
                code = await process.wait()
                raise EngineStartError(self._fail(f"engine process exited during startup (code {code})"))
            bodies = splitter.feed(data)
            for i, body in enumerate(bodies):
                message = decode_from_engine(body)
                if isinstance(message, Ready):
                    return message, bodies[i + 1 :]  # the rest is the reader task's
                if isinstance(message, EngineFailed):
                    raise EngineStartError(self._fail(f"engine failed to start: {message.message}"))

    async def _stop_process(self, process: trio.Process) -> None:
        if process.returncode is None and self.ready is not None:  # a loading engine reads no Shutdown: killed
            try:
                await process.stdin.send_all(encode_frame(Shutdown()))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            with trio.move_on_after(5):
                await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        for stream in (process.stdin, process.stdout):
            await stream.aclose()

    def _fail(self, why: str) -> str:
        """Mark the engine dead and tell the listener (which ends every request in flight)."""
        if self.dead is None:
            self.dead = why
            log.error("%s", why)
            if self.listener is not None:
                self.listener.on_engine_dead(self, why)
            for event in (*self._pongs.values(), *self._adapter_events.values()):
                event.set()
        return self.dead

    # ------------------------------------------------------------------ tasks

    async def _write_loop(self, process: trio.Process) -> None:
        receive = self._receive
        stdin = process.stdin
        async for frame in receive:  # encoded by the caller (submit_nowait): nothing here can fail on data
            frames = [frame]
            while True:  # everything already queued goes in one write
                try:
                    frames.append(receive.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await stdin.send_all(b"".join(frames))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the reader task sees EOF and reports the death

    async def _heartbeat_loop(self, process: trio.Process) -> None:
        while self.dead is None:
            await trio.sleep(self.heartbeat_interval)
            if await self.ping(self.heartbeat_timeout) is None and self.dead is None:
                channel = self._send.statistics()
                if channel.current_buffer_used >= channel.max_buffer_size:  # the ping was not even queued
                    self._fail(f"engine stopped reading its pipe: the frontend -> engine channel is full "
                               f"({channel.max_buffer_size} messages)")
                else:
                    self._fail(f"engine did not answer a heartbeat within {self.heartbeat_timeout} s")
                process.kill()  # a hung engine is not coming back; the reader task sees EOF
            elif (why := self.step_bound.why_stuck(self.progress)) is not None and self.dead is None:
                self._fail(why)
                process.kill()

    async def _read_loop(self, process: trio.Process, splitter: FrameSplitter, bodies: list[bytes]) -> None:
        # Wait, then read: one scheduling round and one read per engine report. (The stream's
        # receive_some reads first, so every report cost a read that failed with EAGAIN, and it
        # yields once more after the read.)
        fd = process.stdout.fileno()
        handle = self._handle
        while True:
            for body in bodies:
                handle(decode_from_engine(body))
            await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, 1 << 16)  # below malloc's mmap threshold: no page faults per read
                self.read_time = time.monotonic()
            except BlockingIOError:
                bodies = []
                continue
            except OSError:
                return  # the pipe broke: the same as EOF
            if not data:
                return
            bodies = splitter.feed(data)

    def _handle(self, message) -> None:
        if isinstance(message, StepReport):
            self.stats = message.stats
            if self.listener is not None:
                self.listener.on_report(message, self)
        elif isinstance(message, Pong):
            self.stats, self.progress = message.stats, message.progress
            event = self._pongs.get(message.nonce)
            if event is not None:
                event.set()
        elif isinstance(message, AdapterLoaded):
            event = self._adapter_events.get(message.adapter_id)
            if event is not None:
                self._adapter_answers[message.adapter_id] = message
                event.set()
        elif isinstance(message, EngineFailed):
            self._fail(f"engine failed: {message.message}")


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group; the frontend decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def channel_capacity(max_in_flight: float) -> float:
    """Each admitted request puts at most one add and one abort in the channel."""
    return math.inf if math.isinf(max_in_flight) else 2 * int(max_in_flight) + 64
