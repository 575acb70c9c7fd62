"""n > 1 streamed through the one event stream, in process: real mailboxes, readers and renderers, the
engine's outputs put into the mailboxes by hand (deterministic: nothing runs but the stream's task).
What a client reads when every choice ends, and when one of them fails while the others still run."""

from __future__ import annotations

import json

import trio

from tidal.errors import ApiError
from tidal.openai.choices import stream_choices
from tidal.openai.encoding import ChunkEncoder
from tidal.registry.lifecycle import ActiveRequest
from tidal.registry.mailbox import Mailbox
from tidal.service.reader import OutputReader
from tidal.wire import RequestOutput, SamplingParams


class Frontend:
    """What a reader asks of the frontend once its first output is in hand."""

    def note_backlog(self, request: ActiveRequest) -> None:
        pass


def choices(n: int) -> tuple[list[OutputReader], list[ChunkEncoder]]:
    readers = []
    for i in range(n):
        request = ActiveRequest(request_id=i + 1, priority=0, arrival_time=0.0, num_prompt_tokens=3,
                                params=SamplingParams(max_tokens=4), mailbox=Mailbox(1 << 20))
        first = RequestOutput(i + 1, [10 + i], f"c{i}a", num_cached_tokens=2)
        readers.append(OutputReader(Frontend(), request, first, stream_interval=1))  # type: ignore[arg-type]
    first = ChunkEncoder("chat", "tidal-tiny")
    return readers, [first] + [ChunkEncoder("chat", "tidal-tiny", i, first) for i in range(1, n)]


async def frames(body) -> list:
    """The SSE events a client reads, parsed ([DONE] as the string)."""
    events = []
    async for frame in body:
        for line in frame.decode().split("\n\n"):
            if line:
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_every_choice_streams_to_its_finish_then_one_usage_and_done():
    readers, encoders = choices(2)
    for i, reader in enumerate(readers):
        reader.request.mailbox.close(RequestOutput(i + 1, [20 + i], f"c{i}b", finish_reason="length",
                                                   num_cached_tokens=2))
    events = await frames(stream_choices(readers, encoders, include_usage=True))
    *chunks, usage, done = events
    assert done == "[DONE]"
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == 3
    assert usage["usage"]["completion_tokens"] == 4 and usage["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "c0ac0b", 1: "c1ac1b"} and finishes == {0: "length", 1: "length"}
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1], "round-robin from choice 0"
    assert len({c["id"] for c in chunks}) == 1


async def test_a_choice_that_fails_ends_the_stream_with_its_error_and_done():
    readers, encoders = choices(2)
    readers[1].request.mailbox.close(ApiError(503, "The request is aborted by a higher priority request.",
                                              "service_unavailable", None, 503))
    # choice 0 would go on; the stream must end at choice 1's error, without usage
    events = await frames(stream_choices(readers, encoders, include_usage=True))
    *chunks, error, done = events
    assert done == "[DONE]"
    assert error["error"]["code"] == 503 and "higher priority" in error["error"]["message"]
    assert all("error" not in c and c["choices"] for c in chunks)
    assert not any(c.get("usage") for c in chunks)


async def test_an_unexpected_error_in_one_choice_is_an_error_chunk_not_a_dropped_stream():
    readers, encoders = choices(2)
    readers[0].request.mailbox.close(RequestOutput(1, [20], "c0b", finish_reason="stop"))

    def broken(*args):
        raise RuntimeError("a bug")

    encoders[1].chunk_json = broken  # type: ignore[method-assign]
    events = await frames(stream_choices(readers, encoders, include_usage=False))
    *chunks, error, done = events
    assert done == "[DONE]" and error["error"]["code"] == 500
    assert [c["choices"][0]["index"] for c in chunks] == [0]


class ArrivesAfterThePick(Mailbox):
    """A mailbox whose output comes just after the stream looked for output and saw none: put
    before anyone parked on it, so the put wakes nobody."""

    def __init__(self, late: RequestOutput):
        super().__init__(1 << 20)
        self.late: RequestOutput | None = late

    @property
    def idle(self) -> bool:
        late, self.late = self.late, None
        if late is not None:
            self.put_nowait(late)
            return True  # what the look saw, an instant before
        return super().idle


async def test_output_that_came_while_the_stream_began_to_wait_is_read():
    readers, encoders = choices(2)
    readers[0].request.mailbox.close(RequestOutput(1, [20], "c0b", finish_reason="length", num_cached_tokens=2))
    readers[1].request.mailbox = ArrivesAfterThePick(RequestOutput(2, [21], "c1b", finish_reason="length",
                                                                   num_cached_tokens=2))
    with trio.fail_after(5):  # the last choice's end must not be waited for once it is there
        events = await frames(stream_choices(readers, encoders, include_usage=False))
    texts = {0: "", 1: ""}
    for chunk in events[:-1]:
        [choice] = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {0: "c0ac0b", 1: "c1ac1b"} and events[-1] == "[DONE]"
