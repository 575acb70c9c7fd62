"""A request's life in the frontend, as one state table. Only ``ActiveRequest.move_to`` changes state.

::

    QUEUED --started--> RUNNING --finish reason from the engine--> FINISHED
       |                   |
       +---- abort --------+-----> ABORTED   (client gone, slow client, shutdown, engine failure)
       +---- reject -------------> REJECTED  (queue timeout, evicted by a more urgent request, shutdown)

FINISHED, ABORTED and REJECTED are final. The engine has forgotten a FINISHED request; for
the other two the frontend has sent (or is sending) an abort.

``RequestTable`` is the set of live (not final) requests. It learns of every transition from
``move_to``, so its counts of queued and running requests (and of the requests through each LoRA
adapter) are derived, never kept by hand.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

import trio

from tidal.registry.mailbox import Mailbox
from tidal.observe.timeline import Timeline
from tidal.wire import SamplingParams


class RequestState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"
    REJECTED = "rejected"


_FINAL = frozenset({RequestState.FINISHED, RequestState.ABORTED, RequestState.REJECTED})
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: frozenset({RequestState.RUNNING, RequestState.FINISHED, RequestState.ABORTED,
                                    RequestState.REJECTED}),
    RequestState.RUNNING: frozenset({RequestState.FINISHED, RequestState.ABORTED}),
    RequestState.FINISHED: frozenset(),
    RequestState.ABORTED: frozenset(),
    RequestState.REJECTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


@dataclass(eq=False)
class ActiveRequest:
    request_id: int
    priority: int
    # admitted at, on the trio clock (its deadlines and latency histograms); the engine orders by it too.
    # The hop story's stamps, which must line up with the engine's, are on its timeline (monotonic).
    arrival_time: float
    num_prompt_tokens: int
    params: SamplingParams
    mailbox: Mailbox
    state: RequestState = RequestState.QUEUED
    engine: Any = field(default=None, repr=False)  # the engine client (replica) that runs it
    table: RequestTable | None = field(default=None, repr=False)  # None outside a frontend (tests)
    abort_reason: str | None = None
    first_output_time: float | None = None
    last_output_time: float | None = None
    # the scope that enforces --max-queue-wait while the request is queued
    queue_scope: trio.CancelScope | None = field(default=None, repr=False)
    # its clock from first byte to last frame, every hop stamped (tidal/observe/timeline.py); the one owner
    timeline: Timeline = field(default_factory=lambda: Timeline(0.0), repr=False)
    # speculative decoding: tokens proposed for it and accepted, as its latest engine output counted them
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # the OutputReader that reads it (tidal/service/reader.py), the one owner of its output count and
    # finish reason; None until its handler has one
    reader: Any = field(default=None, repr=False)
    adapter: str | None = None  # the name of the LoRA adapter it runs through; None: the base model

    @property
    def is_final(self) -> bool:
        return self.state in _FINAL

    @property
    def urgency(self) -> tuple[int, float, int]:
        """Lower is more urgent (vLLM's convention: lower priority value is served first)."""
        return (self.priority, self.arrival_time, self.request_id)  # ids count up: the earlier first

    def move_to(self, new: RequestState) -> None:
        old = self.state
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"request {self.request_id}: {old.value} -> {new.value}")
        self.state = new
        if self.table is not None:
            self.table._moved(self, old, new)


class RequestTable:
    """The live requests by id, and how many are queued and running (derived from ``move_to``)."""

    def __init__(self) -> None:
        self.live: dict[int, ActiveRequest] = {}
        self.num_queued = 0  # admitted, not yet scheduled by the engine
        self.num_running = 0  # scheduled, not yet final (the frontend's view)
        # LoRA adapter name -> live requests through it, and the queued and running ones' adapters apart
        self.adapters: collections.Counter[str] = collections.Counter()
        self.queued_adapters: collections.Counter[str] = collections.Counter()
        self.running_adapters: collections.Counter[str] = collections.Counter()
        self._idle = trio.Event()
        self._idle.set()

    def add(self, request: ActiveRequest) -> None:
        """Start tracking a newly admitted (QUEUED) request."""
        assert request.state is RequestState.QUEUED and request.table is None
        request.table = self
        self.live[request.request_id] = request
        self.num_queued += 1
        if request.adapter is not None:
            self.adapters[request.adapter] += 1
            self.queued_adapters[request.adapter] += 1
        if len(self.live) == 1:
            self._idle = trio.Event()

    def queued(self) -> list[ActiveRequest]:
        return [r for r in self.live.values() if r.state is RequestState.QUEUED]

    async def wait_idle(self) -> None:
        """Until no request is live."""
        await self._idle.wait()

    def _moved(self, request: ActiveRequest, old: RequestState, new: RequestState) -> None:
        # only QUEUED and RUNNING have transitions out, and a live request is in one of them
        if old is RequestState.QUEUED:
            self.num_queued -= 1
        else:
            self.num_running -= 1
        if new is RequestState.RUNNING:
            self.num_running += 1
        else:
            del self.live[request.request_id]
            if not self.live:
                self._idle.set()
        if request.adapter is not None:
            _move_count(self.queued_adapters if old is RequestState.QUEUED else self.running_adapters,
                        self.running_adapters if new is RequestState.RUNNING else None, request.adapter)
            if new is not RequestState.RUNNING:
                _move_count(self.adapters, None, request.adapter)


def _move_count(source: collections.Counter, target: collections.Counter | None, key: str) -> None:
    """One count of ``key`` from ``source`` to ``target`` (None: gone); a key counted zero times is dropped."""
    source[key] -= 1
    if not source[key]:
        del source[key]
    if target is not None:
        target[key] += 1
