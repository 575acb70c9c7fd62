"""A request's mailbox: where the frontend leaves engine output for its handler.

The frontend never waits for a handler. ``put_nowait`` merges a new output into the
undelivered one (lossless: token ids and text are concatenated), so a handler that falls
behind reads one bigger delta instead of a backlog of small ones. What a slow reader may
leave undelivered (text, token ids and logprobs: ``output_bytes``) is bounded by ``max_bytes``;
past it the mailbox reports an overflow
and the request is aborted as a slow client.

A reader that can use an output the moment it arrives (a stream whose socket takes the frame
at once, see ``EventStream``) may set ``direct`` while it waits: ``put_nowait`` then offers each
non-final output to it first, from the frontend's reader task, and wakes the reader only for
what it declines. That saves a task wake-up per token for every stream that keeps up.

Every request's mailbox ends with either a final output (``finish_reason`` set: the engine's,
or "abort" from the frontend) or an error (an ``ApiError``): the one way a reader learns that
its request is over.
"""

from __future__ import annotations

from typing import Callable

import trio

from tidal.wire import RequestOutput


def output_bytes(output: RequestOutput) -> int:
    """What an undelivered output holds, as counted against ``max_bytes``: its text, its token ids
    and its logprobs (a float per token and an id and a float per top alternative; with 20 top
    logprobs that is ~40x the text, so they must count)."""
    size = len(output.text) + 4 * len(output.token_ids)
    logprobs = output.logprobs
    if logprobs is not None:
        size += 8 * len(logprobs.token_logprobs) + 12 * sum(map(len, logprobs.top_token_ids))
    return size


class Mailbox:
    __slots__ = ("_pending", "_lot", "_closed_reason", "num_merged", "num_pending_chunks",
                 "pending_bytes", "max_bytes", "last_take_time", "last_backlog", "direct")

    def __init__(self, max_bytes: int):
        self._pending: RequestOutput | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self._closed_reason: BaseException | None = None
        self.max_bytes = max_bytes
        self.num_merged = 0  # outputs merged into another one, over the request's life
        self.num_pending_chunks = 0  # outputs in the undelivered delta
        self.last_backlog = 0  # chunks merged into the last delivered delta
        self.pending_bytes = 0
        self.last_take_time = trio.current_time()
        # set by a waiting reader: takes a non-final output now (True) or declines it (False)
        self.direct: Callable[[RequestOutput], bool] | None = None

    def put_nowait(self, output: RequestOutput) -> bool:
        """Leave ``output`` for the reader. False if the undelivered bytes exceed the bound."""
        pending = self._pending
        if pending is None:
            direct = self.direct
            if direct is not None:
                if output.finish_reason is None and direct(output):
                    return True
                # the reader waits with nothing pending: it has taken everything until now
                self.last_take_time = trio.current_time()
            self._pending = output
        else:
            pending.merge(output)
            self.num_merged += 1
        self.num_pending_chunks += 1
        self.pending_bytes += output_bytes(output)
        self._lot.unpark_all()
        return self.pending_bytes <= self.max_bytes

    def close(self, ending: RequestOutput | BaseException, discard: bool = False) -> None:
        """End the request: the reader gets what is pending (unless ``discard``), then ``ending``.

        ``ending`` is a final output (``finish_reason`` set), which ``take`` returns like any
        other, or an error, which ``take`` raises once nothing is pending.
        """
        if discard:
            self._pending = None
            self.pending_bytes = 0
            self.num_pending_chunks = 0
        if isinstance(ending, RequestOutput):
            self.put_nowait(ending)
        elif self._closed_reason is None:
            self._closed_reason = ending
        self._lot.unpark_all()

    def wake(self) -> None:
        """Wake a reader parked in ``wait`` although nothing is pending (its ``direct`` needs it)."""
        self._lot.unpark_all()

    async def wait(self) -> None:
        """Park until output is pending, the mailbox is closed, or ``wake``. Call it only while
        ``idle`` (so it always parks: a checkpoint). Takes nothing."""
        await self._lot.park()

    @property
    def idle(self) -> bool:
        """Nothing pending and not closed: ``wait`` would park."""
        return self._pending is None and self._closed_reason is None

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def take_nowait(self) -> RequestOutput | None:
        output = self._pending
        if output is not None:
            self._pending = None
            self.last_backlog = self.num_pending_chunks
            self.num_pending_chunks = 0
            self.pending_bytes = 0
            self.last_take_time = trio.current_time()
        return output

    async def take(self) -> RequestOutput:
        """Wait for output. Raises the close reason once nothing is pending.

        Always a checkpoint. Cancellation leaves the pending output in place.
        """
        if self._pending is None:
            while self._pending is None:  # parking is the checkpoint
                if self._closed_reason is not None:
                    raise self._closed_reason
                await self._lot.park()
        else:
            await trio.lowlevel.checkpoint()  # a backlog is waiting: still yield once
        return self.take_nowait()  # type: ignore[return-value]
