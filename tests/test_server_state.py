"""/state's "aborted in the last minute": counted from the Prometheus counters, a minute of samples."""

from __future__ import annotations

import trio

from tidal.observe.metrics import Metrics
from tidal.observe.server_state import ServerState
from tidal.wire import EngineStats


async def test_an_abort_counts_for_a_minute_then_leaves_the_window(autojump_clock):
    metrics = Metrics("m")
    stats = EngineStats(num_running=1, num_waiting=2, num_total_blocks=8, num_used_blocks=2)
    state = ServerState(metrics, lambda: stats, lambda: 3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(state.sample)
        await trio.sleep(5.5)
        metrics.aborted.labels("m", "client_cancel").inc()
        metrics.rejected.labels("m", "queue_full").inc(2)
        snapshot = state.snapshot()
        assert snapshot["aborted_last_minute"]["client_cancel"] == 1
        assert snapshot["rejected_last_minute"]["queue_full"] == 2
        assert snapshot["aborted_last_minute"]["client_disconnect"] == 0
        assert (snapshot["requests_running"], snapshot["requests_waiting"], snapshot["frontend_requests"],
                snapshot["kv_blocks_used"], snapshot["kv_blocks_total"], snapshot["kv_usage"]) == (1, 2, 3, 2, 8, 0.25)
        await trio.sleep(65.2 - 5.5)  # the window starts at 5.2: the sample before the abort is its base
        assert state.snapshot()["aborted_last_minute"]["client_cancel"] == 1
        await trio.sleep(1.5)  # the window starts at 6.7: every sample in it already had the abort
        assert state.snapshot()["aborted_last_minute"]["client_cancel"] == 0
        assert state.snapshot()["rejected_last_minute"]["queue_full"] == 0
        metrics.aborted.labels("m", "slow_client").inc()
        assert state.snapshot()["aborted_last_minute"]["slow_client"] == 1
        nursery.cancel_scope.cancel()
