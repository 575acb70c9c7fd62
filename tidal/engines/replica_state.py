"""A data-parallel replica's life, as one state table. Only ``Replica.move_to`` changes state.

::

    STARTING --ready--> SERVING --died--> RESTARTING --backoff over--> STARTING
       |                                     ^   |
       +---------------- died ---------------+   +--too many failures in a row--> DOWN

DOWN is final. Whether a replica serves is this state and nothing else: the router asks it at
every route (``Router.replica_up`` is handed the question when the replica enters SERVING), and
the count of its lives (``generation``) is the router's alone (``tidal/engines/router.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tidal.wire import Ready


class ReplicaState(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    RESTARTING = "restarting"  # dead, waiting out its backoff
    DOWN = "down"  # dead for good


TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.STARTING: frozenset({ReplicaState.SERVING, ReplicaState.RESTARTING}),
    ReplicaState.SERVING: frozenset({ReplicaState.RESTARTING}),
    ReplicaState.RESTARTING: frozenset({ReplicaState.STARTING, ReplicaState.DOWN}),
    ReplicaState.DOWN: frozenset(),
}


class IllegalReplicaTransition(RuntimeError):
    pass


@dataclass(eq=False)
class Replica:
    index: int
    state: ReplicaState = ReplicaState.STARTING
    client: Any = None  # the EngineClient of its current (or last) life
    ready: Ready | None = None  # what its latest life reported when its model was loaded
    num_restarts: int = 0
    last_error: str | None = None

    def move_to(self, new: ReplicaState) -> ReplicaState:
        """Change state by the table; returns the old state. Raises ``IllegalReplicaTransition``."""
        old = self.state
        if new not in TRANSITIONS[old]:
            raise IllegalReplicaTransition(f"replica {self.index}: {old.value} -> {new.value}")
        self.state = new
        return old
