"""Responses of n > 1 choices: one OutputReader per choice, joined into one response.

Each choice is its own engine request (its own mailbox, finish_reason and random stream; the
engine forks choices 1..n-1 off choice 0's prefilled prompt). Every choice is read as its output
comes, never one after another: a choice still queued (``--max-num-seqs`` below n) or one longer
than the others must not leave the rest unread, or their stall timer ends them as slow clients.
Without stream, each choice is collected by its own task. A stream is the one ``EventStream``
(tidal/service/stream.py) over ``ChoicesReader``, which reads the choices as one source of deltas
(round-robin, the next one with output waiting; when none has, whichever has output first), and
``ChoicesRenderer``, which puts each delta in its choice's chunk (with its ``index``: OpenAI clients
assemble choices by index). Usage counts the prompt once and sums the completions.
"""

from __future__ import annotations

from typing import Any

import trio

from tidal.errors import ApiError
from tidal.openai.encoding import ChatRenderer, ChunkEncoder, usage
from tidal.registry.lifecycle import ActiveRequest
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


class ChoicesReader:
    """The n choices' readers read as one source of deltas for the one ``EventStream``.

    Each delta is one choice's (``current``): the choices are served round-robin, the next one with
    output waiting, and when none has, it waits for whichever has output first. It is done when
    every choice is, or at the first error (the response then ends with that error).
    """

    plain = False  # every frame names its choice: no direct sends of bare text

    def __init__(self, readers: list[OutputReader]):
        self.readers = readers
        # the choice whose delta was read last, and its index (at first the last one, so that
        # round-robin starts at choice 0)
        self.index = len(readers) - 1
        self.current = readers[self.index]
        self.open = list(range(len(readers)))  # choices not finished yet
        self.error: ApiError | None = None

    @property
    def request(self) -> ActiveRequest:
        """The current choice's request: the frame of its delta is stamped on its timeline."""
        return self.current.request

    @property
    def done(self) -> bool:
        return not self.open or self.error is not None

    async def next_delta(self) -> str:
        """The next delta of the choice served next (``current``). Raises the ApiError that ended it."""
        index = self._pick()
        while index is None:
            await self._wait_for_output()
            index = self._pick()
        self.index = index
        self.current = self.readers[index]
        try:
            text = await self.current.next_delta()
        except ApiError as error:
            self.error = error
            raise
        if self.current.done:
            self.open.remove(index)
        return text

    def usage(self) -> dict[str, Any]:
        return _usage(self.readers)

    def _pick(self) -> int | None:
        """Round-robin after the choice served last: the first with output waiting, or still queued
        past its wait (its read refuses it: ``--max-queue-wait`` holds for every choice)."""
        now = trio.current_time()
        order = sorted(self.open, key=lambda i: (i <= self.index, i))
        return next((i for i in order if self.readers[i].has_output or self.readers[i].queue_deadline <= now), None)

    async def _wait_for_output(self) -> None:
        """Park until any open choice has output (or its end) waiting, or a queued one's wait is over."""
        async with trio.open_nursery() as nursery:
            nursery.cancel_scope.deadline = min(self.readers[i].queue_deadline for i in self.open)
            for i in self.open:
                nursery.start_soon(self._wait_for, self.readers[i].request.mailbox, nursery.cancel_scope)

    @staticmethod
    async def _wait_for(mailbox: Mailbox, scope: trio.CancelScope) -> None:
        if mailbox.idle:  # output that came after the pick, before this task ran, woke nobody
            await mailbox.wait()
        scope.cancel()


class ChoicesRenderer(ChatRenderer):
    """n choices' chunks: each delta in its choice's chunk (with its ``index``), then the usage of
    every choice (if asked) and [DONE] once, after the last; an error ends them all."""

    def __init__(self, encoders: list[ChunkEncoder], include_usage: bool):
        super().__init__(encoders[0], include_usage)
        self.content_frame = None
        self.choices = [ChatRenderer(encoder, False) for encoder in encoders]

    def frames(self, reader: ChoicesReader, text: str) -> bytes:  # type: ignore[override]
        return self.choices[reader.index].frames(reader.current, text)


def stream_choices(readers: list[OutputReader], encoders: list[ChunkEncoder], include_usage: bool,
                   writer: Writer | None = None) -> EventStream:
    """The SSE body of n choices: the one event stream over the choices read as one."""
    return EventStream(ChoicesReader(readers), ChoicesRenderer(encoders, include_usage), writer)  # type: ignore[arg-type]
