"""The one event-stream body: a request's frames, from its reader through a renderer to the transport.

Every streamed answer is this body: chat and completions (SSE chunks), Responses (typed events),
Messages (Anthropic's events) and a WebSocket request (chunk messages). What differs is the
``Renderer``: the frames an API sends before the first delta, for each delta, after the last, and
for an error. The body owns the rest, once:

- the loop over the reader's ``next_delta`` (a delta that says nothing sends nothing): a request's
  ``OutputReader``, or the n choices of one read as one (``ChoicesReader``, tidal/openai/choices.py);
- the error boundary: an ``ApiError`` that ends the request, or any unexpected exception, becomes
  the renderer's error frame, which ends the stream (never a dropped connection);
- direct writes: once the headers are out, frames go straight to the socket through the ``Writer``
  the transport handed in (tidal/http/fast_send.py), and a stream that has caught up has its
  frames sent by the engine reader task (``_offer``): no task wake-up per token.

The body is a small async-iterator class rather than a generator so that every frame its task
sends is a real checkpoint (a mailbox ``take`` or ``wait``), which keeps a handler whose client
vanished from spinning. Whatever the engine produced while the client was still taking the
previous frame goes as one frame. A body holds nothing to release: a request not over when its
body ends (the client went away) is closed by the handler's RequestScope (tidal/registry/frontend.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import trio

from tidal.errors import ApiError, internal_error
from tidal.service.reader import OutputReader
from tidal.wire import RequestOutput

log = logging.getLogger("tidal.service.stream")


class Renderer(Protocol):
    """An API's frames for one streamed answer (bytes, ready for the transport)."""

    # a non-final delta's frame from its text alone, for a caught-up stream (None: no such shortcut)
    content_frame: Callable[[str], bytes] | None

    def opening(self, reader: OutputReader) -> bytes: ...  # before the first delta (b"": none)

    def frames(self, reader: OutputReader, text: str) -> bytes: ...  # for one delta (b"": nothing to say)

    def closing(self, reader: OutputReader) -> bytes: ...  # after the last delta

    def error_frame(self, error: ApiError) -> bytes: ...  # the stream's last frame when it fails


class Writer(Protocol):
    """The transport's direct write of body frames (tidal/http/fast_send.BodyWriter)."""

    async def write(self, data: bytes) -> bool: ...  # False: not possible (any more): use the ASGI path

    def ready(self) -> bool: ...

    def send_now(self, data: bytes) -> bytes | None: ...

    async def write_framed(self, framed: bytes) -> None: ...


class EventStream:
    """The async iterable a transport sends as the body (SSE) or as messages (WebSocket).

    ``separate_closing``: hand the closing frames out as their own item (a WebSocket sends each item
    as one message); otherwise they go with the last delta's frames, in one socket write.
    """

    def __init__(self, reader: OutputReader, renderer: Renderer, writer: Writer | None = None,
                 separate_closing: bool = False):
        self.reader = reader
        self.renderer = renderer
        self.writer = writer  # writes frames straight to the socket once the headers are out
        self.separate_closing = separate_closing
        # one engine output is one frame, with nothing to hold back or accumulate
        self._direct = writer is not None and renderer.content_frame is not None and reader.plain
        self._unsent = b""  # the tail of a frame the socket did not take in ``_offer``
        self._opened = False
        self._closing_due = False  # the closing frames come next, as their own item (separate_closing)
        self._over = False  # every frame has been made
        self._stamp = False  # the frame made last carries a delta (or the error that replaced one)

    def __aiter__(self) -> "EventStream":
        return self

    async def __anext__(self) -> bytes:
        # the transport sent the headers before asking for the first frame: from here on, frames
        # can go straight to the socket; the transport then only ends the body
        reader = self.reader
        while self.writer is not None:
            if self._unsent:
                tail, self._unsent = self._unsent, b""
                await self.writer.write_framed(tail)
                reader.request.timeline.wrote(time.monotonic())
            elif self._direct and self._opened and not self._over and reader.caught_up and self.writer.ready():
                mailbox = reader.request.mailbox
                mailbox.direct = self._offer
                try:
                    await mailbox.wait()
                finally:
                    mailbox.direct = None
            else:
                frame = await self.next_frame()
                if frame is None:
                    raise StopAsyncIteration
                if not await self.writer.write(frame):
                    self.writer = None
                    self._wrote()  # handed to the transport's own send
                    return frame
                self._wrote()
        frame = await self.next_frame()
        if frame is None:
            raise StopAsyncIteration
        self._wrote()  # handed to the transport's own send
        return frame

    def _wrote(self) -> None:
        if self._stamp:  # on the timeline of the request whose delta it carries
            self.reader.request.timeline.wrote(time.monotonic())

    def _offer(self, output: RequestOutput) -> bool:
        """Send a non-final output's frame now, from the reader task; False: let this task do it."""
        if output.logprobs is not None or output.error is not None:
            return False
        reader = self.reader
        text = output.text
        if text:  # no text (held back by the stop-string check): nothing to say yet
            try:
                frame = self.renderer.content_frame(text)  # type: ignore[misc]
            except Exception:  # whatever it is, it belongs to this request's task, not the reader's
                return False
            tail = self.writer.send_now(frame)  # type: ignore[union-attr]
            if tail is None:
                return False
            if not tail:
                reader.request.timeline.wrote(time.monotonic())
            else:  # the socket is full: this task sends the rest, then waits for the client
                self._unsent = tail
                mailbox = reader.request.mailbox
                mailbox.direct = None
                mailbox.last_take_time = trio.current_time()
                mailbox.wake()
        reader.count(output)
        return True

    async def next_frame(self) -> bytes | None:
        """The next frames to send (one delta's, with the closing ones after the last), or None when
        the stream is over. This request's error boundary: nothing raised here ends the connection."""
        if self._over:
            return None
        reader, renderer = self.reader, self.renderer
        try:
            if self._closing_due:  # made now, after the last delta's frame went out (its stamp counts)
                self._over, self._stamp = True, False
                return renderer.closing(reader)
            if not self._opened:
                self._opened = True
                frame = renderer.opening(reader)
                if frame:
                    self._stamp = False
                    return frame
            while True:
                text = await reader.next_delta()
                frame = renderer.frames(reader, text)
                if reader.done:
                    if self.separate_closing and frame:
                        self._closing_due = True
                    else:
                        self._over = True
                        frame += renderer.closing(reader)
                if frame:
                    self._stamp = True
                    return frame
        except ApiError as error:  # the request ended early (slow client, engine failure, a bad constraint)
            frame = renderer.error_frame(error)
        except Exception as exc:  # a bug: this request's stream ends with an error frame, nothing else's
            log.exception("request %d: unexpected error while streaming", reader.request.request_id)
            reader.error = internal_error(exc)
            frame = renderer.error_frame(reader.error)
        self._over, self._closing_due, self._stamp = True, False, True
        return frame
