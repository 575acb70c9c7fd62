"""Live servers for the cancellation suite, started in parallel.

A ``tidal serve`` start costs several seconds on the shared 2-core CI machine, and this
suite needs servers with different flags (and some tests kill theirs). So every server
the collected tests ask for is started at once, in threads, the first time any of them is
needed; each fixture then waits only for its own. Servers that a test kills are used by
that one test only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cancel_helpers import scrape_health
from live_server import LiveServer, ServerPool

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


class PooledServer(LiveServer):
    """A LiveServer whose start waits cheaply.

    ``LiveServer.start`` polls /health with ``httpx.get``, which builds a new client (and SSL
    context: ~50 ms of CPU) every 0.1 s; seven servers starting at once polled that way
    keep a whole core busy. This start watches the log for the ready line instead, then
    checks /health once.
    """

    def start(self) -> None:
        env = {**os.environ, "TIDAL_ENGINE_LOG_LEVEL": "WARNING", **(self.env or {})}
        cmd = [sys.executable, "-m", "tidal", "serve", "--port", str(self.port), *self.args]
        self.process = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.start_timeout
        while "tidal ready:" not in self.log():
            if self.process.poll() is not None:
                raise RuntimeError(f"tidal serve exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tidal serve did not become ready:\n{self.log()}")
            time.sleep(0.1)
        health = scrape_health(self)
        if health != 200:
            raise RuntimeError(f"tidal serve is ready but /health says {health}:\n{self.log()}")


@pytest.fixture(scope="session")
def _server_pool(request):
    wanted = {name for item in request.session.items for name in item.fixturenames if name in SERVER_FLAGS}
    pool = ServerPool({name: (*COMMON_FLAGS, *SERVER_FLAGS[name]) for name in wanted}, PooledServer)
    yield pool
    pool.stop_all()


def _server_fixture(name: str, scope: str):
    @pytest.fixture(scope=scope, name=name)
    def server(_server_pool) -> LiveServer:
        return _server_pool.get(name)

    return server


seq1_server = _server_fixture("seq1_server", "session")
wide_server = _server_fixture("wide_server", "session")
slow_step_server = _server_fixture("slow_step_server", "session")
drain_server = _server_fixture("drain_server", "function")
second_signal_server = _server_fixture("second_signal_server", "function")
engine_kill_server = _server_fixture("engine_kill_server", "function")
engine_hang_server = _server_fixture("engine_hang_server", "function")
