"""The engine process's OpenMP wait setting: a short spin by default, the user's own setting kept."""

from __future__ import annotations

import os

import psutil
import pytest
from live_server import LiveServer

OMP_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def engine_omp_env(server: LiveServer) -> dict[str, str]:
    environ = psutil.Process(server.engine_pid()).environ()
    return {key: environ[key] for key in OMP_KEYS if key in environ}


@pytest.mark.parametrize("user_env, expected", [
    ({}, {"GOMP_SPINCOUNT": "10000"}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
    ({"GOMP_SPINCOUNT": "300000"}, {"GOMP_SPINCOUNT": "300000"}),
], ids=["default", "user-policy", "user-spin"])
def test_engine_gets_a_short_spin_unless_the_user_set_a_wait(monkeypatch, user_env, expected):
    for key in OMP_KEYS:
        monkeypatch.delenv(key, raising=False)
    assert not any(key in os.environ for key in OMP_KEYS)
    with LiveServer("--model", "tidal-test", env=user_env) as server:
        assert engine_omp_env(server) == expected
