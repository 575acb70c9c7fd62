"""Responses of n > 1 choices: one OutputReader per choice, joined into one response.

Each choice is its own engine request (its own mailbox, finish_reason and random stream; the
engine forks choices 1..n-1 off choice 0's prefilled prompt). Every choice is read as its output
comes, never one after another: a choice still queued (``--max-num-seqs`` below n) or one longer
than the others must not leave the rest unread, or their stall timer ends them as slow clients.
Without stream, each choice is collected by its own task. A stream interleaves the choices'
frames, each chunk with its ``index`` (OpenAI clients assemble choices by index): it serves the
choices round-robin, taking the next one that has output waiting, and when none has, waits for
whichever has output first. Usage counts the prompt once and sums the completions.
"""

from __future__ import annotations

from typing import Any

import trio

from tidal.errors import ApiError
from tidal.openai.encoding import SSE_DONE, ChatRenderer, ChunkEncoder, sse, usage
from tidal.registry.mailbox import Mailbox
from tidal.service.reader import OutputReader, collect
from tidal.service.stream import EventStream, Writer


def _usage(readers: list[OutputReader]) -> dict[str, Any]:
    first = readers[0]
    return usage(first.request.num_prompt_tokens, sum(r.num_tokens for r in readers), first.num_cached_tokens)


async def collect_choices(readers: list[OutputReader], encoders: list[ChunkEncoder]) -> dict[str, Any]:
    """The whole response of n choices (stream=false), each read by its own task. Raises the
    first ApiError a choice ends with (the others are then no longer read; the caller closes them)."""
    responses: list[dict[str, Any]] = []
    errors: list[ApiError] = []

    async def read(reader: OutputReader, encoder: ChunkEncoder, scope: trio.CancelScope) -> None:
        try:
            responses.append(await collect(reader, ChatRenderer(encoder, False)))
        except ApiError as error:
            errors.append(error)
            scope.cancel()

    async with trio.open_nursery() as nursery:
        for reader, encoder in zip(readers, encoders):
            nursery.start_soon(read, reader, encoder, nursery.cancel_scope)
    if errors:
        raise errors[0]
    responses.sort(key=lambda response: response["choices"][0]["index"])
    whole = responses[0]
    whole["choices"] = [response["choices"][0] for response in responses]
    whole["usage"] = _usage(readers)
    return whole


class ChoicesSseBody:
    """The SSE body of n choices: each choice's frames in turn, then one usage chunk and [DONE]."""

    def __init__(self, readers: list[OutputReader], encoders: list[ChunkEncoder], include_usage: bool,
                 writer: Writer | None = None):
        self.readers = readers
        self.encoders = encoders
        self.include_usage = include_usage
        # one event stream per choice, without its own usage (this body's [DONE] is the last)
        self.bodies = [EventStream(r, ChatRenderer(e, False)) for r, e in zip(readers, encoders)]
        self.writer = writer
        self.open = list(range(len(readers)))  # choices not finished yet
        self.last = -1  # the choice served last
        self.finished = False

    def __aiter__(self) -> "ChoicesSseBody":
        return self

    async def __anext__(self) -> bytes:
        if self.finished:
            raise StopAsyncIteration
        frame = await self._next_frame()
        writer = self.writer
        while writer is not None and not self.finished:
            if not await writer.write(frame):
                self.writer = None
                return frame
            frame = await self._next_frame()
        return frame

    def _pick(self) -> int | None:
        """The next choice to serve: round-robin after the last one, the first with output waiting."""
        order = sorted(self.open, key=lambda i: (i <= self.last, i))
        return next((i for i in order if self.readers[i].has_output), None)

    async def _wait_for_output(self) -> None:
        """Park until any open choice has output (or its end) waiting."""
        async with trio.open_nursery() as nursery:
            for i in self.open:
                nursery.start_soon(self._wait_for, self.readers[i].request.mailbox, nursery.cancel_scope)

    @staticmethod
    async def _wait_for(mailbox: Mailbox, scope: trio.CancelScope) -> None:
        await mailbox.wait()
        scope.cancel()

    async def _next_frame(self) -> bytes:
        index = self._pick()
        while index is None:
            await self._wait_for_output()
            index = self._pick()
        self.last = index
        body = self.bodies[index]
        frame = await body.next_frame()
        assert frame is not None  # an open choice has a frame to come: its last ends with [DONE]
        if frame.endswith(SSE_DONE):
            frame = frame[: -len(SSE_DONE)]
            if body.reader.error is not None:  # a choice failed: the response ends with its error
                self.finished = True
                return frame + SSE_DONE
            self.open.remove(index)
            if not self.open:
                self.finished = True
                if self.include_usage:
                    frame += sse(self.encoders[0].usage_json(_usage(self.readers)))
                frame += SSE_DONE
        return frame
