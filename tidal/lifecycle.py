"""A request's life in the frontend, as one state table. Only ``ActiveRequest.move_to`` changes state.

::

    QUEUED --started--> RUNNING --finish reason from the engine--> FINISHED
       |                   |
       +---- abort --------+-----> ABORTED   (client gone, slow client, shutdown, engine failure)
       +---- reject -------------> REJECTED  (queue timeout, evicted by a more urgent request)

FINISHED, ABORTED and REJECTED are final. The engine has forgotten a FINISHED request; for
the other two the frontend has sent (or is sending) an abort.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import trio

from tidal.mailbox import Mailbox
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
    arrival_time: float  # trio clock
    arrival_order: int
    num_prompt_tokens: int
    params: SamplingParams
    mailbox: Mailbox
    state: RequestState = RequestState.QUEUED
    abort_reason: str | None = None
    first_output_time: float | None = None
    last_output_time: float | None = None
    num_output_tokens: int = 0
    # the scope that enforces --max-queue-wait while the request is queued
    queue_scope: trio.CancelScope | None = field(default=None, repr=False)

    @property
    def is_final(self) -> bool:
        return self.state in _FINAL

    @property
    def urgency(self) -> tuple[int, float, int]:
        """Lower is more urgent (vLLM's convention: lower priority value is served first)."""
        return (self.priority, self.arrival_time, self.arrival_order)

    def move_to(self, new: RequestState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.request_id}: {self.state.value} -> {new.value}")
        self.state = new
