"""The replica supervisor (tidal/engines/replicas.py) over fake engine clients, on Trio's virtual clock.

Rules for determinism: every engine is a ``FakeClient`` that starts at once and dies only when
the test says so; ``autojump_clock`` makes restart backoffs exact virtual times; every test runs
under ``fail_after``.
"""

from __future__ import annotations

import pytest
import trio

from tidal.engines.client import EngineDead, EngineStartError
from tidal.engines.replicas import ReplicaSet, ReplicaState
from tidal.engines.router import Router
from tidal.wire import EngineStats, Ready, StepReport


class FakeClient:
    def __init__(self, index: int, fail_start: bool = False):
        self.index = index
        self.fail_start = fail_start
        self.stats = EngineStats(num_total_blocks=100)
        self.dead: str | None = None
        self.listener = None
        self._die = trio.Event()

    def attach(self, listener) -> None:
        self.listener = listener

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(0.5)  # loading the model
        if self.fail_start:
            self.dead = "engine failed to start: bad model"
            raise EngineStartError(self.dead)
        task_status.started(Ready("m", 64, 4, 100, 8, "cpu", "float32", 100, [1], 1000 + self.index))
        await self._die.wait()
        self.dead = "engine process exited (code -9)"
        self.listener.on_engine_dead(self, self.dead)
        raise EngineDead(self.dead)

    async def ping(self, timeout: float):
        return None if self.dead else self.stats

    def kill(self) -> None:
        self._die.set()


class Frontend:
    """Records what the supervisor hands on."""

    def __init__(self):
        self.reports: list[tuple[StepReport, FakeClient]] = []
        self.deaths: list[tuple[FakeClient, str]] = []

    def on_report(self, report, engine) -> None:
        self.reports.append((report, engine))

    def on_engine_dead(self, engine, why) -> None:
        self.deaths.append((engine, why))


def make_set(num_replicas: int, max_restarts: int, fail_start=()):
    clients: list[FakeClient] = []

    def make_client(index: int) -> FakeClient:
        clients.append(FakeClient(index, fail_start=index in fail_start))
        return clients[-1]

    replicas = ReplicaSet(make_client, num_replicas, Router(num_replicas, 4), max_restarts=max_restarts)
    frontend = Frontend()
    replicas.attach(frontend)
    return replicas, clients, frontend


def prompt(n: int) -> list[int]:
    return [n] * 8


async def test_starts_all_routes_across_them_and_counts_reported_finishes(autojump_clock):
    replicas, clients, frontend = make_set(2, max_restarts=0)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            ready = await nursery.start(replicas.run)
            assert ready.pid == 1000 and trio.current_time() == 0.5  # both loaded at once
            picked = [replicas.pick(prompt(n)) for n in range(4)]
            assert [c.index for c in picked] == [0, 1, 0, 1]
            first = replicas.replicas[0].client
            first.listener.on_report(StepReport([], [], [1, 3], first.stats), first)
            assert [v.num_assigned for v in replicas.router.replicas] == [0, 2]
            assert frontend.reports[0][1] is first  # handed on to the frontend, naming the replica
            assert len(replicas.serving) == 2 and await replicas.health() is None
            assert replicas.stats.num_total_blocks == 200  # the server-wide gauges sum the replicas
            nursery.cancel_scope.cancel()


async def test_a_dead_replica_is_replaced_while_the_other_serves(autojump_clock):
    replicas, clients, frontend = make_set(2, max_restarts=3)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(replicas.run)
            first = replicas.replicas[0].client
            first.kill()
            await trio.sleep(0.01)
            assert frontend.deaths == [(first, "engine process exited (code -9)")]
            assert [r.state for r in replicas.replicas] == [ReplicaState.RESTARTING, ReplicaState.SERVING]
            assert {replicas.pick(prompt(n)).index for n in range(4)} == {1}
            assert len(replicas.serving) == 1 and await replicas.health() is None
            # backoff 1 s, then 0.5 s to load: serving again at t = 0.5 + 1 + 0.5
            while replicas.replicas[0].state is not ReplicaState.SERVING:
                await trio.sleep(0.01)
            assert trio.current_time() == pytest.approx(2.0, abs=0.02)
            assert len(clients) == 3 and replicas.replicas[0].client is clients[2] is not first
            assert replicas.replicas[0].num_restarts == 1
            assert replicas.pick(prompt(99)).index == 0  # the least loaded again
            nursery.cancel_scope.cancel()


async def test_backoff_doubles_and_a_replica_that_keeps_dying_is_given_up(autojump_clock):
    replicas, clients, _ = make_set(2, max_restarts=2)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(replicas.run)
            deaths = []
            for _ in range(3):
                replica = replicas.replicas[0]
                while replica.state is not ReplicaState.SERVING:
                    await trio.sleep(0.01)
                deaths.append(trio.current_time())
                replica.client.kill()
                await trio.sleep(0.01)
            # restarted after 1 s, then 2 s (each plus 0.5 s to load); the third death is final
            assert [round(t - deaths[0], 1) for t in deaths] == [0.0, 1.5, 4.0]
            assert replicas.replicas[0].state is ReplicaState.DOWN
            assert replicas.healthy and replicas.pick(prompt(0)).index == 1
            nursery.cancel_scope.cancel()


async def test_the_server_fails_only_when_every_replica_is_down_for_good(autojump_clock):
    replicas, clients, _ = make_set(2, max_restarts=0)
    with trio.fail_after(10):
        with pytest.raises(ExceptionGroup) as failure:
            async with trio.open_nursery() as nursery:
                await nursery.start(replicas.run)
                replicas.replicas[0].client.kill()
                await trio.sleep(1)
                assert replicas.healthy and replicas.replicas[0].state is ReplicaState.DOWN
                assert "replica 0 down" in replicas.why_down()
                replicas.replicas[1].client.kill()
                await trio.sleep(1)
    assert failure.group_contains(EngineDead, match="no engine replica is serving", depth=None)
    assert not replicas.healthy
    with pytest.raises(EngineDead, match="no engine replica is serving"):
        replicas.pick(prompt(0))


async def test_one_replica_without_restarts_fails_like_one_engine(autojump_clock):
    replicas, clients, frontend = make_set(1, max_restarts=0)
    with trio.fail_after(10):
        with pytest.raises(ExceptionGroup) as failure:
            async with trio.open_nursery() as nursery:
                await nursery.start(replicas.run)
                clients[0].kill()
    assert failure.group_contains(EngineDead, depth=None)
    assert len(clients) == 1 and len(frontend.deaths) == 1


async def test_a_replica_that_cannot_start_stops_the_server(autojump_clock):
    replicas, clients, _ = make_set(2, max_restarts=5, fail_start={1})
    with trio.fail_after(10):
        with pytest.raises(ExceptionGroup) as failure:
            async with trio.open_nursery() as nursery:
                await nursery.start(replicas.run)
    assert failure.group_contains(EngineStartError, match="bad model", depth=None)
    assert len(clients) == 2  # no restart of a replica that never served


async def test_a_late_report_from_a_dead_life_does_not_release_the_new_lifes_requests(autojump_clock):
    replicas, clients, frontend = make_set(1, max_restarts=3)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(replicas.run)
            first = replicas.replicas[0].client
            first.kill()
            while replicas.replicas[0].state is not ReplicaState.SERVING or replicas.replicas[0].client is first:
                await trio.sleep(0.01)
            replicas.pick(prompt(1))
            replicas.pick(prompt(2))
            # the dead engine's last report, read after its successor started: not this life's requests
            first.listener.on_report(StepReport([], [], [1, 2], first.stats), first)
            assert replicas.router.replicas[0].num_assigned == 2
            second = replicas.replicas[0].client
            second.listener.on_report(StepReport([], [], [3], second.stats), second)
            assert replicas.router.replicas[0].num_assigned == 1
            assert [engine for _, engine in frontend.reports] == [first, second]  # both still reach the frontend
            nursery.cancel_scope.cancel()
