"""The engine's side of the pipes: one reader thread, one writer thread.

The step loop never blocks on I/O. The reader thread decodes frames into an inbox the
loop drains between steps, hands each abort straight to the engine (``on_abort``)
(applied in the middle of a step) and answers each ping itself (``on_ping``): the engine's
pulse, independent of how long a step takes. A step report goes out from the step loop itself when
the writer thread is idle and the pipe takes the whole frame (a non-blocking write: no
thread hand-off per step); otherwise the writer thread sends it, and while it is busy (the
pipe is full: the frontend is behind), new step reports are *merged* into the pending one,
request by request, so nothing is dropped and the loop never waits.
"""

from __future__ import annotations

import os
import queue
import select
import threading
import time
from collections.abc import Callable

from tidal.wire import (
    HEADER_SIZE,
    AbortRequests,
    AddRequest,
    EngineConfig,
    Ping,
    FrameSplitter,
    RequestOutput,
    Shutdown,
    StepReport,
    ToEngine,
    decode_config,
    decode_to_engine,
    encode_frame,
    frame_length,
)


def read_config(fd: int) -> EngineConfig:
    """The one EngineConfig frame a parent writes to a new engine or rank process, read blocking."""
    return decode_config(_read_exact(fd, frame_length(_read_exact(fd, HEADER_SIZE))))


def _read_exact(fd: int, size: int) -> bytes:
    chunks = []
    while size:
        data = os.read(fd, size)
        if not data:
            raise EOFError("the parent closed the pipe before sending the engine config")
        chunks.append(data)
        size -= len(data)
    return b"".join(chunks)

# The reader blocks (and the pipe fills, pushing back on the frontend) past this many
# undrained messages. The frontend's own admission bound keeps it far below this.
INBOX_MAX_MESSAGES = 65536


class Inbox:
    """Frames from the frontend, decoded by a daemon thread."""

    def __init__(self, fd: int, on_abort: Callable[[AbortRequests], None] | None = None,
                 on_ping: Callable[[Ping], None] | None = None):
        self._fd = fd
        self._queue: queue.Queue[ToEngine] = queue.Queue(INBOX_MAX_MESSAGES)
        # an abort also goes here at once, for the step in flight (the queued copy keeps order)
        self._on_abort = on_abort
        self._on_ping = on_ping  # answers a ping on this thread (None: queued like the rest)
        self._thread = threading.Thread(target=self._run, name="tidal-engine-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        splitter = FrameSplitter()
        try:
            while True:
                data = os.read(self._fd, 1 << 16)
                if not data:
                    break  # the frontend is gone: behave as if told to shut down
                for body in splitter.feed(data):
                    message = decode_to_engine(body)
                    if type(message) is AddRequest:
                        message.received_at = time.monotonic()  # the request's "engine_received" stamp
                    elif self._on_abort is not None and isinstance(message, AbortRequests):
                        self._on_abort(message)  # stamped there, before the queued copy can be handled
                    elif self._on_ping is not None and type(message) is Ping:
                        self._on_ping(message)
                        continue
                    self._queue.put(message)
        except OSError:
            pass
        self._queue.put(Shutdown())

    def get(self, timeout: float | None) -> ToEngine | None:
        """Wait up to ``timeout`` seconds (None: forever) for one message."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self) -> ToEngine | None:
        try:
            return self._queue.get_nowait()
        except queue.Empty:
            return None


class Outbox:
    """Messages to the frontend; step reports merge while the writer is busy."""

    def __init__(self, fd: int):
        self._fd = fd
        os.set_blocking(fd, False)  # a write from the step loop must never wait for the frontend
        self._lock = threading.Condition()
        self._control: list = []  # Ready, Pong, EngineFailed: sent in order, before reports
        self._report: StepReport | None = None
        self._outputs: dict[int, RequestOutput] = {}
        self._unsent = b""  # the rest of a frame the step loop could not write whole: sent first
        self._writing = False  # the writer thread is writing (outside the lock)
        self._broken = False  # the frontend is gone
        self._closed = False
        self.num_merged_reports = 0
        self.num_direct_reports = 0  # written by the step loop itself
        self._thread = threading.Thread(target=self._run, name="tidal-engine-writer", daemon=True)
        self._thread.start()

    def put_control(self, message) -> None:
        with self._lock:
            self._control.append(message)
            self._lock.notify()

    def put_report(self, report: StepReport) -> None:
        with self._lock:
            if self._broken:
                return
            if not (self._report or self._control or self._unsent or self._writing):
                self._write_now(report)
                return
            pending = self._report
            if pending is None:
                self._report = report
                self._outputs = {o.request_id: o for o in report.outputs}
            else:
                self.num_merged_reports += 1
                pending.started.extend(report.started)
                for out in report.outputs:
                    earlier = self._outputs.get(out.request_id)
                    if earlier is None:
                        self._outputs[out.request_id] = out
                        pending.outputs.append(out)
                    else:
                        earlier.merge(out)
                pending.finished.extend(report.finished)
                pending.stats = report.stats
            self._lock.notify()

    def _write_now(self, report: StepReport) -> None:
        """Write one report from the caller's thread (lock held, nothing else pending); what
        the pipe does not take now is left to the writer thread."""
        report.sent_at = time.monotonic()
        data = encode_frame(report)
        try:
            written = os.write(self._fd, data)
        except BlockingIOError:
            written = 0
        except OSError:
            self._broken = True  # the reader will see EOF and stop the loop
            return
        self.num_direct_reports += 1
        if written < len(data):
            self._unsent = data[written:]
            self._lock.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Flush what is pending, then stop the writer."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._unsent or self._control or self._report or self._closed):
                    self._lock.wait()
                unsent, self._unsent = self._unsent, b""
                control, self._control = self._control, []
                report, self._report = self._report, None
                self._outputs = {}
                closing = self._closed
                self._writing = True
            data = unsent + b"".join(encode_frame(m) for m in control)
            if report is not None:
                report.sent_at = time.monotonic()
                data += encode_frame(report)
            try:
                if data:
                    _write_all(self._fd, data)
            except OSError:
                with self._lock:
                    self._broken = True
                return  # the frontend is gone; the reader will see EOF and stop the loop
            with self._lock:
                self._writing = False
                if closing and not (self._unsent or self._control or self._report):
                    return


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])  # the pipe is full: wait until the frontend reads
            continue
        view = view[written:]
