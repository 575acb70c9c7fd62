"""From a request's mailbox to the bytes of its response: SSE frames, or the final JSON.

The body is a small async-iterator class rather than a generator so that ``aclose`` always
runs our cleanup, and every frame is a real checkpoint (a mailbox ``take``), which keeps a
handler whose client vanished from spinning (hypercorn's send becomes a no-op then).
Whatever the engine produced while the client was still writing the previous frame is
sent as one frame: one socket send for many tokens.
"""

from __future__ import annotations

from typing import Any

import trio

from tidal.engine_client import EngineDead
from tidal.fast_send import BodyWriter
from tidal.frontend import Frontend, ShutdownAbort, engine_unavailable
from tidal.lifecycle import ActiveRequest
from tidal.protocol import SSE_DONE, ApiError, ChunkEncoder, sse, usage
from tidal.token_logprobs import LogprobsFormatter
from tidal.wire import Logprobs, RequestOutput


class OutputReader:
    """Reads a request's outputs as deltas of at least ``stream_interval`` tokens (plus the last)."""

    def __init__(self, frontend: Frontend, request: ActiveRequest, first: RequestOutput, stream_interval: int,
                 logprobs: LogprobsFormatter | None = None):
        self.frontend = frontend
        self.request = request
        self.stream_interval = stream_interval
        self.logprobs = logprobs  # set when the request asked for logprobs
        self._logprob_ids: list[int] = []  # tokens (and their logprobs) not yet taken
        self._logprob_values = Logprobs([], [], [])
        self._first: RequestOutput | None = first
        self.num_tokens = 0
        self.num_cached_tokens = first.num_cached_tokens
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.done = False

    async def next_delta(self) -> tuple[str, str | None]:
        """The next (text, finish_reason). Raises ApiError / ShutdownAbort if the request ended early."""
        text_parts: list[str] = []
        tokens = 0
        mailbox = self.request.mailbox
        while True:
            if self._first is not None:
                output, self._first = self._first, None
                await trio.lowlevel.checkpoint()
            else:
                try:
                    output = await mailbox.take()
                except EngineDead as exc:
                    self.frontend.abort(self.request, "engine_error")
                    raise engine_unavailable(str(exc)) from None
                self.frontend.note_backlog(self.request)
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
                self.done = True
                return "".join(text_parts), output.finish_reason
            if tokens >= self.stream_interval:
                return "".join(text_parts), None

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
    """The async iterable quart sends as a ``text/event-stream`` body."""

    def __init__(self, reader: OutputReader, encoder: ChunkEncoder, include_usage: bool,
                 writer: BodyWriter | None = None):
        self.reader = reader
        self.encoder = encoder
        self.include_usage = include_usage
        self.writer = writer  # writes frames straight to the socket once the headers are out
        self._finished = False
        self._pending_text = ""  # text held until a chunk may carry it (never an empty chunk)

    def __aiter__(self) -> "SseBody":
        return self

    async def __anext__(self) -> bytes:
        # quart sent the headers before asking for the first chunk: from here on, frames can go
        # straight to the socket; quart then only ends the body
        writer = self.writer
        while writer is not None and not self._finished:
            frame = await self._next_frame()
            if not await writer.write(frame):
                self.writer = None
                return frame
        if self._finished:
            raise StopAsyncIteration
        return await self._next_frame()

    async def _next_frame(self) -> bytes:
        reader = self.reader
        while True:
            try:
                text, finish = await reader.next_delta()
            except ShutdownAbort:
                text, finish = "", "abort"
            except ApiError as error:
                self._finished = True
                return sse(error.json()) + SSE_DONE
            text = self._pending_text + text
            self._pending_text = ""
            if finish is None and not text:
                continue  # e.g. text held back by the stop-string check: nothing to say yet
            frame = sse(self.encoder.chunk_json(text, finish, reader.take_logprobs()))
            if finish is not None:
                self._finished = True
                if self.include_usage:
                    frame += sse(self.encoder.usage_json(reader.usage()))
                frame += SSE_DONE
            return frame

    async def aclose(self) -> None:
        self.reader.frontend.close(self.reader.request)


async def collect(reader: OutputReader, encoder: ChunkEncoder) -> dict[str, Any]:
    """The whole completion as one OpenAI response object (stream=false)."""
    parts = []
    try:
        while not reader.done:
            text, _ = await reader.next_delta()
            parts.append(text)
    except ShutdownAbort:
        reader.finish_reason = "abort"
    return encoder.full_response("".join(parts), reader.finish_reason, reader.usage(), reader.stop_reason,
                                 reader.take_logprobs())
