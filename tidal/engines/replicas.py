"""Data-parallel engine replicas under one supervisor: start N, route requests, replace the dead.

Nursery nesting is lifetime nesting::

    ReplicaSet.run                    ready once every replica has loaded its model
      _supervise(replica 0)           EngineClient.run; when it dies: back off, start a new one
      ...
      _supervise(replica N-1)

Each replica is an ``EngineClient`` (its own process, pipes and device) at a time, and its life is
the state table of ``tidal/engines/replica_state.py``; ``_move`` is the table's one writer, and the
router (``tidal/engines/router.py``) asks that table whether a replica serves at every route. Each
life of a replica (each client) gets a listener: it counts the requests that client reports
finished for the router, under the life's generation, then hands the report to the frontend
(``on_report``). When a
replica dies its requests fail through the frontend's ``on_engine_dead`` (error frames, as with
one engine), the router stops sending it requests at once, and the other replicas keep serving.

Restart policy: a replica that dies is started again after 1, 2, 4 ... s (at most 30 s), up to
``max_restarts`` times in a row; a life of ``stable_after`` seconds resets the count. A replica
that fails its very first start stops the server (a bad model or flag will not get better).
When no replica is serving or about to restart, ``run`` raises ``EngineDead``: exit code 3.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import msgspec
import trio

from tidal.engines.client import EngineClient, EngineDead, EngineStartError
from tidal.engines.replica_state import Replica, ReplicaState
from tidal.engines.router import Decision, NoReplica, Router
from tidal.wire import AdapterSpec, EngineConfig, EngineStats, Ready, StepReport

log = logging.getLogger("tidal.engines.replicas")

RESTART_BACKOFF = 1.0  # seconds before the first restart; doubled per failure in a row
MAX_RESTART_BACKOFF = 30.0
STABLE_AFTER = 60.0  # a replica that served this long has its run of failures forgotten


def replica_config(config: EngineConfig, index: int, num_replicas: int) -> EngineConfig:
    """Replica ``index``'s engine settings: its rank (its GPU on CUDA) and, unless given, a fair
    share of the CPU cores for its torch threads (N engines with a thread per core each would
    fight over every core)."""
    threads = config.num_threads
    if threads is None and num_replicas > 1:
        threads = max(1, (os.cpu_count() or 1) // num_replicas)
    return msgspec.structs.replace(config, data_parallel_rank=index, num_threads=threads)


class _Started:
    """A ``task_status`` that calls back instead of resuming a ``nursery.start``."""

    def __init__(self, callback: Callable[[Ready], None]):
        self.callback = callback

    def started(self, value: Ready) -> None:
        self.callback(value)


class ReplicaSet:
    def __init__(self, make_client: Callable[[int], EngineClient], num_replicas: int, router: Router, *,
                 max_restarts: int, restart_backoff: float = RESTART_BACKOFF,
                 max_restart_backoff: float = MAX_RESTART_BACKOFF, stable_after: float = STABLE_AFTER):
        self.make_client = make_client
        self.router = router
        self.replicas = [Replica(i) for i in range(num_replicas)]
        self.max_restarts = max_restarts
        self.restart_backoff = restart_backoff
        self.max_restart_backoff = max_restart_backoff
        self.stable_after = stable_after
        self.listener = None  # the frontend
        self.ever_served = False
        self._all_started = trio.Event()
        self.on_routed: Callable[[Decision], None] = lambda decision: None  # metrics hook

    def attach(self, listener) -> None:
        """Send every replica's reports (and deaths) to ``listener`` (the frontend)."""
        self.listener = listener

    # ------------------------------------------------------------------ requests

    def pick(self, prompt_token_ids: list[int]) -> EngineClient:
        """The replica that will serve this request soonest (it is counted there). Raises EngineDead."""
        try:
            decision = self.router.route(prompt_token_ids)
        except NoReplica:
            raise EngineDead(self.why_down()) from None
        self.on_routed(decision)
        return self.replicas[decision.index].client  # type: ignore[return-value]

    async def load_adapter(self, spec: AdapterSpec, timeout: float) -> list[str]:
        """Have every serving replica read and check a LoRA adapter, all at once; the reasons of those that cannot."""
        errors: list[str] = []

        async def load(client: EngineClient) -> None:
            error = await client.load_adapter(spec, timeout)
            if error is not None:
                errors.append(error)

        async with trio.open_nursery() as nursery:
            for replica in self.serving:
                nursery.start_soon(load, replica.client)
        return errors

    def unload_adapter(self, adapter_id: int) -> None:
        for replica in self.serving:
            replica.client.unload_adapter_nowait(adapter_id)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ state, for /health and /metrics

    @property
    def serving(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.SERVING]

    @property
    def healthy(self) -> bool:
        return bool(self.serving)

    @property
    def dead(self) -> str | None:
        """Why no request can be served now (None while a replica serves)."""
        return None if self.serving else self.why_down()

    def why_down(self) -> str:
        if not self.ever_served:
            return "still starting"
        if len(self.replicas) == 1:  # as without replicas: the engine's own reason
            replica = self.replicas[0]
            return replica.last_error or f"the engine is {replica.state.value}"
        errors = "; ".join(f"replica {r.index} {r.state.value}: {r.last_error}" for r in self.replicas)
        return f"no engine replica is serving ({errors})"

    @property
    def stats(self) -> EngineStats:
        """The serving replicas' latest stats, summed (steps: the most any replica ran); an attribute,
        as ``EngineClient.stats`` is."""
        total = EngineStats()
        for replica in self.serving:
            s = replica.client.stats  # type: ignore[union-attr]
            total.step = max(total.step, s.step)
            for name in ("num_running", "num_waiting", "num_total_blocks", "num_used_blocks",
                         "num_cached_blocks", "num_prefix_hit_tokens", "num_preemptions", "spec_num_drafts",
                         "spec_num_draft_tokens", "spec_num_accepted_tokens"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
            total.aborts_freed = [a + b for a, b in zip(total.aborts_freed, s.aborts_freed)]
            per_pos = total.spec_accepted_per_pos
            per_pos += [0] * (len(s.spec_accepted_per_pos) - len(per_pos))
            for position, count in enumerate(s.spec_accepted_per_pos):
                per_pos[position] += count
        return total

    def snapshot(self) -> list[tuple[int, bool, EngineStats, int]]:
        """(index, serving, latest stats, restarts) of every replica, for /metrics."""
        return [(r.index, r.state is ReplicaState.SERVING, r.client.stats if r.client else EngineStats(),
                 r.num_restarts) for r in self.replicas]

    async def health(self, timeout: float = 2.0) -> str | None:
        """None if at least one replica answers a ping within ``timeout``; else why not."""
        serving = self.serving
        if not serving:
            return self.why_down()
        answered = False
        async with trio.open_nursery() as nursery:
            async def ping(client: EngineClient) -> None:
                nonlocal answered
                if await client.ping(timeout) is not None:
                    answered = True
                    nursery.cancel_scope.cancel()
            for replica in serving:
                nursery.start_soon(ping, replica.client)
        return None if answered else f"no engine replica answered within {timeout:g} s"

    # ------------------------------------------------------------------ lifetime

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start every replica; report the first one's Ready once all serve; supervise until cancelled.

        Raises ``EngineStartError`` if a replica fails its first start, ``EngineDead`` once no
        replica serves and none can be restarted.
        """
        async with trio.open_nursery() as nursery:
            for replica in self.replicas:
                nursery.start_soon(self._supervise, replica)
            await self._all_started.wait()
            task_status.started(self.replicas[0].ready)

    async def _supervise(self, replica: Replica) -> None:
        failures = 0  # deaths in a row, each after a life shorter than stable_after
        while True:
            client = replica.client = self.make_client(replica.index)
            listener = _ReplicaListener(self, replica)  # one per life: its finishes count in this life only
            client.attach(listener)
            born_at: float | None = None

            def up(ready: Ready) -> None:
                nonlocal born_at
                listener.generation = self._up(replica, ready)
                born_at = trio.current_time()

            try:
                await client.run(task_status=_Started(up))
            except EngineDead as exc:
                replica.last_error = str(exc)
            self._died(replica)
            if born_at is None and not self.ever_served:
                raise EngineStartError(replica.last_error or "engine replica failed to start")
            lived = 0.0 if born_at is None else trio.current_time() - born_at
            failures = 1 if lived >= self.stable_after else failures + 1
            if failures > self.max_restarts:
                self._move(replica, ReplicaState.DOWN)
                if not any(r.state is not ReplicaState.DOWN for r in self.replicas):
                    raise EngineDead(self.why_down())
                log.error("replica %d: not restarted after %d failures in a row; %d replica(s) serving",
                          replica.index, failures, len(self.serving))
                return
            delay = min(self.max_restart_backoff, self.restart_backoff * 2 ** (failures - 1))
            log.warning("replica %d died (%s); restarting it in %g s", replica.index, replica.last_error, delay)
            await trio.sleep(delay)
            replica.num_restarts += 1
            self._move(replica, ReplicaState.STARTING)

    def _move(self, replica: Replica, new: ReplicaState) -> None:
        """The one writer of a replica's state. The router asks this state whether it may route there
        (it keeps no copy), so leaving SERVING stops new requests at once."""
        replica.move_to(new)

    def _up(self, replica: Replica, ready: Ready) -> int:
        """The replica serves; returns the router's number for this life (``Router.release``)."""
        replica.ready = ready
        self._move(replica, ReplicaState.SERVING)
        client = replica.client
        generation = self.router.replica_up(replica.index, ready.max_num_seqs, ready.num_total_blocks,
                                            lambda: client.stats,
                                            lambda: replica.state is ReplicaState.SERVING)
        if replica.num_restarts:
            log.info("replica %d is serving again (engine pid %d)", replica.index, ready.pid)
        if all(r.ready is not None for r in self.replicas):
            self.ever_served = True
            self._all_started.set()
        return generation

    def _died(self, replica: Replica, why: str | None = None) -> None:
        """The replica's engine is gone (told by its client, or its ``run`` returned): RESTARTING,
        until the restart policy in ``_supervise`` says DOWN."""
        if why is not None:
            replica.last_error = why
        if replica.state is not ReplicaState.RESTARTING:  # the client told us first, or it is told now
            self._move(replica, ReplicaState.RESTARTING)


class _ReplicaListener:
    """Between one life of a replica (one client) and the frontend: counts finished requests for the
    router, under the life's generation, so a late report of a dead life changes no count."""

    def __init__(self, replicas: ReplicaSet, replica: Replica):
        self.replicas = replicas
        self.replica = replica
        self.generation: int | None = None  # the router's number for this life, once it serves

    def on_report(self, report: StepReport, engine: EngineClient) -> None:
        if report.finished and self.generation is not None:
            self.replicas.router.release(self.replica.index, self.generation, len(report.finished))
        if self.replicas.listener is not None:  # None until the frontend exists (start-up)
            self.replicas.listener.on_report(report, engine)

    def on_engine_dead(self, engine: EngineClient, why: str) -> None:
        self.replicas._died(self.replica, why)
        if self.replicas.listener is not None:
            self.replicas.listener.on_engine_dead(engine, why)
