"""Live servers for the cancellation suite, started in parallel.

A ``tidal serve`` start costs several seconds on the shared 2-core CI machine, and this
suite needs servers with different flags (and some tests kill theirs). So every server
the collected tests ask for is asked of the session's pool at once, the first time any of them
is needed; each fixture then waits only for its own. Servers that a test kills are used by
that one test only.
"""

from __future__ import annotations

import pytest

from live_server import LiveServer, wanted

# Small, single-threaded engines: seven of them share two cores while they start.
COMMON_FLAGS = ("--engine-threads", "1", "--num-kv-blocks", "2048", "--tokenizer-workers", "1")

# Step times are chosen so a step is long against the frontend's reaction time (about
# 1 ms) and the test's /metrics polling (5 ms), yet short enough to keep the suite fast.
SERVER_FLAGS: dict[str, tuple[str, ...]] = {
    # one sequence at a time (so a second request waits), 32-token prefill chunks
    "seq1_server": ("--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--min-step-time", "0.1"),
    # defaults (256 sequences, 256 queued): the abort storm and WebSocket tests
    "wide_server": ("--min-step-time", "0.05"),
    # one forward pass lasts a full second: an abort lands in the middle of one
    "slow_step_server": ("--min-step-time", "1.0"),
    # killed by their test:
    "drain_server": ("--min-step-time", "0.05", "--shutdown-timeout", "1"),
    "second_signal_server": ("--min-step-time", "0.05", "--shutdown-timeout", "30"),
    "engine_kill_server": ("--min-step-time", "0.05", "--max-num-seqs", "3"),
    "engine_hang_server": ("--min-step-time", "0.05", "--engine-heartbeat-timeout", "2"),
}


@pytest.fixture(scope="package")
def _server_pool(request, server_pool):
    """Ask for every server the collected tests name at once; each fixture waits only for its own."""
    for name in wanted(request.session, SERVER_FLAGS):
        server_pool.start(name, *COMMON_FLAGS, *SERVER_FLAGS[name])
    yield server_pool
    server_pool.release(*SERVER_FLAGS)


def _server_fixture(name: str, scope: str):
    @pytest.fixture(scope=scope, name=name)
    def server(_server_pool) -> LiveServer:
        live = _server_pool.get(name, *COMMON_FLAGS, *SERVER_FLAGS[name])
        yield live
        if scope == "function":  # killed by its test: used by that test only
            _server_pool.release(name)

    return server


seq1_server = _server_fixture("seq1_server", "package")
wide_server = _server_fixture("wide_server", "package")
slow_step_server = _server_fixture("slow_step_server", "package")
drain_server = _server_fixture("drain_server", "function")
second_signal_server = _server_fixture("second_signal_server", "function")
engine_kill_server = _server_fixture("engine_kill_server", "function")
engine_hang_server = _server_fixture("engine_hang_server", "function")
