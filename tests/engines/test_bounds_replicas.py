"""The replica restart policy's two bounds at N and N+1, with the supervisor's defaults, on Trio's
virtual clock (the code reads ``trio.current_time()``, so ``autojump_clock`` travels through the waits):

* the backoff doubles from 1 s and is capped at ``MAX_RESTART_BACKOFF`` (30 s): the 5th restart in
  a row waits 16 s, the 6th min(32, 30) = 30 s, the 7th 30 s again;
* a life of ``STABLE_AFTER`` (60 s) forgets the run of failures (the next restart waits 1 s again);
  a life just short of it does not.
"""

from __future__ import annotations

import trio
from test_replicas import make_set

from tidal.engines.replicas import MAX_RESTART_BACKOFF, STABLE_AFTER, ReplicaState

LOAD = 0.5  # the fake engine's start-up time (FakeClient.run)


async def serving(replica) -> float:
    while replica.state is not ReplicaState.SERVING:
        await trio.sleep(0.01)
    return trio.current_time()


async def restart_delays(replicas, lives: list[float]) -> list[float]:
    """Kill replica 0 after each of ``lives`` seconds of serving; the backoff waited before each restart."""
    replica = replicas.replicas[0]
    delays = []
    for life in lives:
        await serving(replica)
        await trio.sleep(life)
        replica.client.kill()
        died_at = trio.current_time()
        while replica.state is ReplicaState.SERVING:  # the death is seen at the next checkpoint
            await trio.sleep(0.01)
        delays.append(round(await serving(replica) - died_at - LOAD, 1))
    return delays


async def test_the_restart_backoff_doubles_up_to_its_30_s_cap(autojump_clock):
    assert MAX_RESTART_BACKOFF == 30.0
    replicas, _, _ = make_set(2, max_restarts=20)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(replicas.run)
            delays = await restart_delays(replicas, [1.0] * 8)
            nursery.cancel_scope.cancel()
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]


async def test_a_life_of_60_s_resets_the_backoff_and_one_just_shorter_does_not(autojump_clock):
    assert STABLE_AFTER == 60.0
    replicas, _, _ = make_set(2, max_restarts=20)
    with trio.fail_after(1000):
        async with trio.open_nursery() as nursery:
            await nursery.start(replicas.run)
            # three quick deaths (1, 2, 4 s), a death after 59.9 s of serving (still a run: 8 s),
            # then one after exactly 60 s: stable, so the next restart waits the first backoff again
            delays = await restart_delays(replicas, [1.0, 1.0, 1.0, STABLE_AFTER - 0.1, STABLE_AFTER, 1.0])
            nursery.cancel_scope.cancel()
    assert delays == [1, 2, 4, 8, 1, 2]
    assert replicas.replicas[0].num_restarts == 6
