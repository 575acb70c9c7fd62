"""Responses of n > 1 choices: one OutputReader per choice, joined into one response.

Each choice is its own engine request (its own mailbox, finish_reason and random stream; the
engine forks choices 1..n-1 off choice 0's prefilled prompt). A stream interleaves the choices'
frames, each chunk with its ``index`` (OpenAI clients assemble choices by index): it serves the
choices round-robin, taking the next one that has output waiting, and waits on the next one in
turn when none has (the choices step together, so the others have output by then). Usage counts
the prompt once and sums the completions.
"""

from __future__ import annotations

from typing import Any

from tidal.http.fast_send import BodyWriter
from tidal.openai.encoding import SSE_DONE, ChunkEncoder, sse, usage
from tidal.openai.streaming import OutputReader, SseBody, collect


def _usage(readers: list[OutputReader]) -> dict[str, Any]:
    first = readers[0]
    return usage(first.request.num_prompt_tokens, sum(r.num_tokens for r in readers), first.num_cached_tokens)


async def collect_choices(readers: list[OutputReader], encoders: list[ChunkEncoder]) -> dict[str, Any]:
    """The whole response of n choices (stream=false). Raises ApiError."""
    responses = [await collect(reader, encoder) for reader, encoder in zip(readers, encoders)]
    whole = responses[0]
    whole["choices"] = [response["choices"][0] for response in responses]
    whole["usage"] = _usage(readers)
    return whole


class ChoicesSseBody:
    """The SSE body of n choices: each choice's frames in turn, then one usage chunk and [DONE]."""

    def __init__(self, readers: list[OutputReader], encoders: list[ChunkEncoder], include_usage: bool,
                 writer: BodyWriter | None = None):
        self.readers = readers
        self.encoders = encoders
        self.include_usage = include_usage
        # one SseBody per choice, without its own ending; the first writes straight to the socket
        self.bodies = [SseBody(r, e, False, None) for r, e in zip(readers, encoders)]
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

    def _pick(self) -> int:
        """The next choice to serve: round-robin after the last one, preferring waiting output."""
        order = sorted(self.open, key=lambda i: (i <= self.last, i))
        return next((i for i in order if self.readers[i].has_output), order[0])

    async def _next_frame(self) -> bytes:
        index = self.last = self._pick()
        body = self.bodies[index]
        frame = await body._next_frame()
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

    async def aclose(self) -> None:
        for body in self.bodies:
            await body.aclose()
