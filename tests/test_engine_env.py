"""The engine process's OpenMP wait setting: a short spin by default, the user's own setting kept."""

from __future__ import annotations

import io
import os

import psutil
import pytest
from live_server import LiveServer

from tidal.gpu.parallel import launch
from tidal.wire import OMP_SPIN_COUNT, EngineConfig

OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# what the user set -> what an engine process gets: the short spin, or the user's own wait untouched
WAITS = pytest.mark.parametrize("user_env, expected", [
    ({}, {"GOMP_SPINCOUNT": OMP_SPIN_COUNT}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000"}),
], ids=["default", "user-policy", "user-spin"])


def engine_omp_env(server: LiveServer) -> dict[str, str]:
    environ = psutil.Process(server.engine_pid()).environ()
    return {key: environ[key] for key in OMP_KEYS if key in environ}


@WAITS
def test_engine_gets_a_short_spin_unless_the_user_set_a_wait(monkeypatch, user_env, expected):
    for key in OMP_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert not any(key in os.environ for key in OMP_KEYS)
    with LiveServer("--model", "tidal-test", env=user_env) as server:
        assert engine_omp_env(server) == expected


@WAITS
def test_a_headless_nodes_ranks_get_the_same_wait(monkeypatch, user_env, expected):
    """A headless node (`tidal serve --node-rank 1 ...`) has no frontend: its ranks' environment comes from
    start_rank, which must give them the same OpenMP wait as the frontend gives its engine."""
    started = {}

    class Process:
        stdin = io.BytesIO()

    def popen(args, stdin, env):
        started["env"] = env
        return Process()

    for key in OMP_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in user_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    launch.start_rank(EngineConfig(model="tidal-test", tensor_parallel_size=2), rank=1, master_port=29500)
    assert {key: started["env"][key] for key in OMP_KEYS if key in started["env"]} == expected
    assert started["env"]["RANK"] == "1"
