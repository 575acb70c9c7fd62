"""From a request's mailbox to the bytes of its response: SSE frames, or the final JSON.

The body is a small async-iterator class rather than a generator so that every frame its task
sends is a real checkpoint (a mailbox ``take`` or
``wait``), which keeps a handler whose client vanished from spinning (hypercorn's send becomes
a no-op then). Whatever the engine produced while the client was still writing the previous
frame is sent as one frame: one socket send for many tokens. A stream that has caught up has
its frames sent by the engine reader task instead (``SseBody._offer``): no wake-up per token.
A body holds nothing to release: a request not over when its body ends (the client went away)
is closed by the handler's RequestScope (tidal/registry/frontend.py).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import trio

from tidal.http.fast_send import BodyWriter
from tidal.registry.frontend import Frontend
from tidal.registry.lifecycle import ActiveRequest
from tidal.openai.encoding import SSE_DONE, ChunkEncoder, sse, usage
from tidal.errors import ApiError, bad_request, internal_error
from tidal.service.reasoning import ReasoningSplitter
from tidal.openai.token_logprobs import LogprobsFormatter
from tidal.service.tool_calls import ToolCallStream
from tidal.wire import Logprobs, RequestOutput

log = logging.getLogger("tidal.openai.streaming")


class OutputReader:
    """Reads a request's outputs as deltas of at least ``stream_interval`` tokens (plus the last).

    The reader's end is its mailbox's: a final output (``finish_reason``) or an ``ApiError``.
    """

    def __init__(self, frontend: Frontend, request: ActiveRequest, first: RequestOutput | None, stream_interval: int,
                 logprobs: LogprobsFormatter | None = None, tool_calls: ToolCallStream | None = None,
                 reasoning: ReasoningSplitter | None = None):
        """``first``: the request's first output, or None to wait for it at the first read (a
        choice of n > 1 other than the first, which may still be queued: ``Frontend.first_output``
        then applies its queue bound)."""
        self.frontend = frontend
        self.request = request
        self.stream_interval = stream_interval
        self.logprobs = logprobs  # set when the request asked for logprobs
        self._logprob_ids: list[int] = []  # tokens (and their logprobs) not yet taken
        self._logprob_values = Logprobs([], [], [])
        self._tool_calls = tool_calls  # reads tool calls out of the text (chat with tools)
        self.tool_calls: list[dict[str, Any]] | None = None  # the calls, once the request is over
        self._reasoning = reasoning  # splits the model's thinking out of the text (--reasoning-parser)
        self._reasoning_parts: list[str] = []  # thinking read but not yet taken
        self._first: RequestOutput | None = first
        self._started = first is not None  # the first output has been taken from the mailbox
        self.num_tokens = 0
        self.num_cached_tokens = first.num_cached_tokens if first is not None else 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.error: ApiError | None = None

    @property
    def done(self) -> bool:
        """The last delta (or the error) has been read."""
        return self.finish_reason is not None or self.error is not None

    async def next_delta(self) -> str:
        """The next text delta; ``finish_reason`` is set once it is the last. Raises the ApiError
        that ended the request early (and keeps it in ``error``)."""
        try:
            return await self._next_delta()
        except ApiError as error:  # from the mailbox, or the end of the output (a tool call too deep)
            self.error = error
            raise

    async def _next_delta(self) -> str:
        text_parts: list[str] = []
        tokens = 0
        mailbox = self.request.mailbox
        while True:
            if self._first is not None:
                output, self._first = self._first, None
                await trio.lowlevel.checkpoint()
            elif not self._started:
                output = await self.frontend.first_output(self.request)
                self._started = True
                if output.error is not None:  # refused by the engine before it was scheduled
                    raise bad_request(output.error)
            else:
                output = await mailbox.take()
                self.frontend.note_backlog(self.request)
            if output.error is not None:  # the engine ended it mid-stream for what it asked (a constraint)
                raise bad_request(output.error)
            text_parts.append(output.text)
            if self.logprobs is not None and output.logprobs is not None:
                self._logprob_ids.extend(output.token_ids)
                self._logprob_values.extend(output.logprobs)
            tokens += len(output.token_ids)
            self.num_tokens += len(output.token_ids)
            self.num_cached_tokens = output.num_cached_tokens
            if output.finish_reason is not None:
                self.finish_reason = output.finish_reason
                self.stop_reason = output.stop_reason
                return self._content("".join(text_parts), final=True)
            if tokens >= self.stream_interval:
                return self._content("".join(text_parts), final=False)

    def _content(self, text: str, final: bool) -> str:
        """The message content in ``text``: thinking is set aside (``take_reasoning``) first, then
        tool calls are held back and set at the end."""
        splitter = self._reasoning
        if splitter is not None:
            reasoning, text = splitter.feed(text)
            if final:
                tail_reasoning, tail = splitter.finish()
                reasoning, text = reasoning + tail_reasoning, text + tail
            if reasoning:
                self._reasoning_parts.append(reasoning)
        calls = self._tool_calls
        if calls is None:
            return text
        content = calls.feed(text)
        if final:
            tail, found = calls.finish()
            content += tail
            if found:
                self.tool_calls = [call.to_openai(i) for i, call in enumerate(found)]
                if self.finish_reason == "stop":
                    self.finish_reason = "tool_calls"
        return content

    @property
    def caught_up(self) -> bool:
        """Everything so far has been read and the request is not over: the next read would wait."""
        return self._started and self._first is None and self.request.mailbox.idle

    @property
    def has_output(self) -> bool:
        """Output or the request's end is waiting to be read (reading it will not block)."""
        return self._first is not None or not self.request.mailbox.idle

    def take_reasoning(self) -> str | None:
        """The thinking read since the last call (None without a reasoning parser or nothing new)."""
        if not self._reasoning_parts:
            return None
        text = "".join(self._reasoning_parts)
        self._reasoning_parts = []
        return text

    @property
    def splits_reasoning(self) -> bool:
        return self._reasoning is not None

    def take_logprobs(self) -> dict[str, Any] | None:
        """The OpenAI logprobs object of the tokens read since the last call (None if not asked)."""
        if self.logprobs is None:
            return None
        ids, values = self._logprob_ids, self._logprob_values
        self._logprob_ids, self._logprob_values = [], Logprobs([], [], [])
        return self.logprobs.format(ids, values)

    def usage(self) -> dict[str, Any]:
        return usage(self.request.num_prompt_tokens, self.num_tokens, self.num_cached_tokens)


class SseBody:
    """The async iterable quart sends as a ``text/event-stream`` body.

    Once the headers are out and the stream has caught up, its frames no longer pass through
    this task: while it waits, the mailbox hands each new output to ``_offer``, which the
    frontend's reader task runs right after the engine's report is decoded, and which sends the
    frame to the socket at once (``BodyWriter.send_now``). So a stream that keeps up costs no
    task wake-up per token. Anything else (the final frame, a full socket buffer, logprobs, tool
    calls, ``stream_interval`` > 1) wakes this task and takes the ordinary path.
    """

    def __init__(self, reader: OutputReader, encoder: ChunkEncoder, include_usage: bool,
                 writer: BodyWriter | None = None):
        self.reader = reader
        self.encoder = encoder
        self.include_usage = include_usage
        self.writer = writer  # writes frames straight to the socket once the headers are out
        # one engine output is one frame, with nothing to hold back or accumulate
        self._direct = (writer is not None and reader.stream_interval <= 1 and reader.logprobs is None
                        and reader._tool_calls is None and reader._reasoning is None)
        self._unsent = b""  # the tail of a frame the socket did not take in ``_offer``
        self._timeline = reader.request.timeline  # each frame handed to the socket is stamped on it

    def __aiter__(self) -> "SseBody":
        return self

    async def __anext__(self) -> bytes:
        # quart sent the headers before asking for the first chunk: from here on, frames can go
        # straight to the socket; quart then only ends the body
        reader = self.reader
        mailbox = reader.request.mailbox
        while self.writer is not None and not reader.done:
            if self._unsent:
                tail, self._unsent = self._unsent, b""
                await self.writer.write_framed(tail)
                self._timeline.wrote(time.monotonic())
            elif self._direct and reader.caught_up and self.writer.ready():
                mailbox.direct = self._offer
                try:
                    await mailbox.wait()
                finally:
                    mailbox.direct = None
            else:
                frame = await self._next_frame()
                if not await self.writer.write(frame):
                    self.writer = None
                    self._timeline.wrote(time.monotonic())  # handed to the ASGI send
                    return frame
                self._timeline.wrote(time.monotonic())
        if reader.done:
            raise StopAsyncIteration
        frame = await self._next_frame()
        self._timeline.wrote(time.monotonic())  # handed to the ASGI send
        return frame

    def _offer(self, output: RequestOutput) -> bool:
        """Send a non-final output's frame now, from the reader task; False: let this task do it."""
        if output.logprobs is not None or output.error is not None:
            return False
        reader = self.reader
        text = output.text
        if text:  # no text (held back by the stop-string check): nothing to say yet
            try:
                frame = self.encoder.content_frame(text)
            except Exception:  # whatever it is, it belongs to this request's task, not the reader's
                return False
            tail = self.writer.send_now(frame)  # type: ignore[union-attr]
            if tail is None:
                return False
            if not tail:
                self._timeline.wrote(time.monotonic())
            else:  # the socket is full: this task sends the rest, then waits for the client
                self._unsent = tail
                mailbox = reader.request.mailbox
                mailbox.direct = None
                mailbox.last_take_time = trio.current_time()
                mailbox.wake()
        reader.num_tokens += len(output.token_ids)
        reader.num_cached_tokens = output.num_cached_tokens
        return True

    async def _next_frame(self) -> bytes:
        reader = self.reader
        while True:
            try:
                text = await reader.next_delta()
                finish = reader.finish_reason
                reasoning = reader.take_reasoning()
                if finish is None and not text and not reasoning:
                    continue  # e.g. text held back by the stop-string check: nothing to say yet
                frame = sse(self.encoder.chunk_json(text, finish, reader.take_logprobs(), reader.tool_calls,
                                                    reasoning))
            except ApiError as error:
                return sse(error.json()) + SSE_DONE
            except Exception as exc:  # this request's error boundary: its stream ends with an error frame
                log.exception("request %d: unexpected error while streaming", reader.request.request_id)
                reader.error = internal_error(exc)
                return sse(reader.error.json()) + SSE_DONE
            if finish is not None:
                if self.include_usage:
                    frame += sse(self.encoder.usage_json(reader.usage()))
                frame += SSE_DONE
            return frame


async def collect(reader: OutputReader, encoder: ChunkEncoder) -> dict[str, Any]:
    """The whole completion as one OpenAI response object (stream=false). Raises ApiError."""
    parts = []
    while not reader.done:
        parts.append(await reader.next_delta())
    return encoder.full_response("".join(parts), reader.finish_reason, reader.usage(), reader.stop_reason,
                                 reader.take_logprobs(), reader.tool_calls, reader.take_reasoning())
