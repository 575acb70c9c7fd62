"""A replica's state table (tidal/engines/replica_state.py): the legal lives, and nothing else."""

from __future__ import annotations

import pytest

from tidal.engines.replica_state import TRANSITIONS, IllegalReplicaTransition, Replica, ReplicaState

S = ReplicaState


def test_a_life_that_dies_restarts_and_is_given_up():
    replica = Replica(0)
    for new in (S.SERVING, S.RESTARTING, S.STARTING, S.RESTARTING, S.DOWN):
        replica.move_to(new)
    assert replica.state is S.DOWN


@pytest.mark.parametrize("old, new", [(old, new) for old in S for new in S if new not in TRANSITIONS[old]])
def test_every_other_transition_raises_and_leaves_the_state(old, new):
    replica = Replica(0, state=old)
    with pytest.raises(IllegalReplicaTransition, match=f"replica 0: {old.value} -> {new.value}"):
        replica.move_to(new)
    assert replica.state is old


def test_down_is_final_and_serving_is_reached_only_by_starting():
    assert TRANSITIONS[S.DOWN] == frozenset()
    assert [old for old in S if S.SERVING in TRANSITIONS[old]] == [S.STARTING]
