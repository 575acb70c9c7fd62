"""A request's output as its handler reads it: deltas out of its mailbox, and how its answer ended.

``OutputReader`` is the one owner of what the client is told about a request's output: how many
tokens it read (``num_tokens``, the usage), and why it ended (``finish_reason``: the engine's, or
"tool_calls" once the text turned out to be calls). The request's span reads them here
(``ActiveRequest.reader``). ``collect`` is the one loop that reads a whole answer (stream=false);
a stream's loop is ``EventStream`` (tidal/service/stream.py). Neither knows an API's shape: that
is the renderer's.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import trio

from tidal.errors import ApiError, bad_request
from tidal.registry.frontend import Frontend
from tidal.registry.lifecycle import ActiveRequest
from tidal.service.reasoning import ReasoningSplitter
from tidal.service.tool_calls import ToolCallStream
from tidal.wire import Logprobs, RequestOutput


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object (what chat, completions and the WebSocket report)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class LogprobsFormatter(Protocol):
    """Turns token ids and their logprobs into an API's logprobs object (tidal/openai/token_logprobs.py)."""

    def format(self, ids: list[int], values: Logprobs) -> Any: ...


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
        request.reader = self  # its span reads the count and the finish reason here
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

    def count(self, output: RequestOutput) -> None:
        """An output that went to the client without a read (``EventStream``'s direct send): count it."""
        self.num_tokens += len(output.token_ids)
        self.num_cached_tokens = output.num_cached_tokens

    @property
    def plain(self) -> bool:
        """Each output is one delta as it came: no interval to fill, nothing held back or set aside."""
        return (self.stream_interval <= 1 and self.logprobs is None and self._tool_calls is None
                and self._reasoning is None)

    @property
    def caught_up(self) -> bool:
        """Everything so far has been read and the request is not over: the next read would wait."""
        return self._started and self._first is None and self.request.mailbox.idle

    @property
    def has_output(self) -> bool:
        """Output or the request's end is waiting to be read (reading it will not block)."""
        return self._first is not None or not self.request.mailbox.idle

    @property
    def queue_deadline(self) -> float:
        """When its first read refuses the request for its wait in the queue (infinity once read)."""
        return math.inf if self._started else self.frontend.queue_deadline(self.request)

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


class Collector(Protocol):
    """What an API makes of a whole answer (stream=false): each delta, then the response object."""

    def add(self, reader: OutputReader, text: str) -> None: ...

    def answer(self, reader: OutputReader) -> Any: ...


async def collect(reader: OutputReader, collector: Collector) -> Any:
    """The whole answer as one response object (stream=false). Raises the ApiError that ended it."""
    while not reader.done:
        collector.add(reader, await reader.next_delta())
    return collector.answer(reader)
