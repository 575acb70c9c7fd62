"""A slow step is a live engine; a stopped one is dead within the heartbeat timeout; a stuck step is caught.

The engine's pipe reader thread answers every heartbeat beside the step, with the step's age and
size (tidal/engines/liveness.py). Before, the step loop itself answered: one step longer than
``--engine-heartbeat-timeout`` (a 2,000-token prompt to a real model on a loaded host) ended the
server with exit 3, and so did a frontend event loop that stalled past the timeout.

The engines are tidal-test (``min_step_time``: every forward pass lasts that long, a clock, not
a load). Times asserted are bounds a loaded host keeps, not measurements.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
import trio

from live_server import LiveServer
from tidal.engines.client import EngineClient, EngineDead
from tidal.engines.liveness import StepBound
from tidal.wire import AddRequest, EngineConfig, SamplingParams, StepProgress

LONG_STEP = 12.0  # seconds: longer than the default heartbeat timeout (10 s), twelve times the one used here


def test_a_12_s_step_is_served_and_a_stopped_engine_is_dead_within_the_timeout():
    """One 12 s step on --engine-heartbeat-timeout 1: answered, /health 200 mid-step; SIGSTOP: dead."""
    with LiveServer("--model", "tidal-test", "--min-step-time", str(LONG_STEP), "--engine-heartbeat-timeout", "1",
                    "--no-ui") as server:
        with httpx.Client(timeout=LONG_STEP * 4) as client:
            started = time.monotonic()
            with _HealthPoller(server) as mid_step:
                answer = client.post(server.url + "/v1/completions",
                                     json={"prompt": "Hi", "max_tokens": 1, "ignore_eos": True})
            took = time.monotonic() - started
            assert answer.status_code == 200, answer.text
            assert answer.json()["usage"]["completion_tokens"] == 1
            assert took >= LONG_STEP * 0.9, took  # it really was one long step
            assert mid_step.health == [200] * len(mid_step.health) and mid_step.health, mid_step.health
            assert server.process.poll() is None
            assert "heartbeat" not in server.log()

            # the same engine, stopped mid-step: no answer, declared dead within the timeout
            pid = server.engine_pid()
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                assert server.process.wait(timeout=30) == 3
                # a ping every 1 s, unanswered for 1 s: declared dead by 2 s, then a 1 s grace
                assert time.monotonic() - stopped < 1.0 + 1.0 + 1.0 + 3.0
            finally:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        assert "engine did not answer a heartbeat within 1.0 s" in server.log()


class _HealthPoller:
    """Polls /health every 2 s from a thread while the long request runs."""

    def __init__(self, server: LiveServer):
        self.server, self.health = server, []
        self._stop = False

    def __enter__(self) -> "_HealthPoller":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            time.sleep(3)  # the step has begun
            while not self._stop:
                self.health.append(client.get(self.server.url + "/health").status_code)
                time.sleep(2)

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()


def test_a_2000_token_prompt_to_the_real_model_on_a_1_s_heartbeat_is_answered(smollm2_hf_dir):
    """One prefill step of 2,000+ tokens outlasts a 1 s heartbeat timeout on a loaded host: answered."""
    with LiveServer("--model", smollm2_hf_dir, "--engine-heartbeat-timeout", "1", "--no-ui",
                    "--max-num-batched-tokens", "4096") as server:
        prompt = "The tide comes in over the flats, and the boats lift off the mud one by one. " * 120
        answer = server.client.post(server.url + "/v1/completions", timeout=600,
                                    json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["prompt_tokens"] >= 2000 and usage["completion_tokens"] == 4, usage
        assert server.process.poll() is None
    assert "heartbeat" not in server.log()


async def test_a_frontend_that_stalls_past_the_timeout_does_not_blame_the_engine():
    """The event loop blocked for 4x the heartbeat timeout while a ping waits: the answer counts."""
    client = EngineClient(EngineConfig(model="tidal-test"), channel_capacity=64,
                          heartbeat_interval=0.1, heartbeat_timeout=0.5)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            for _ in range(3):
                answers = []

                async def ping() -> None:
                    answers.append(await client.ping(0.5))

                nursery.start_soon(ping)
                while not client._pongs or client._send.statistics().current_buffer_used:
                    await trio.sleep(0)  # until the writer task has taken the ping
                await trio.sleep(0)  # ... and written it: the engine answers while the frontend is stalled
                time.sleep(2.0)  # a synchronous stall of the whole frontend, the ping unanswered
                await trio.sleep(1.0)
                assert answers == [client.stats], answers
                assert client.dead is None, client.dead
            nursery.cancel_scope.cancel()


async def test_a_step_stuck_past_the_step_timeout_is_declared_hung():
    """The process answers, but its one step runs past --engine-step-timeout with nothing that explains it."""
    client = EngineClient(EngineConfig(model="tidal-test", min_step_time=600), channel_capacity=64,
                          heartbeat_interval=0.2, heartbeat_timeout=5, step_timeout=2)
    with trio.fail_after(120):
        with pytest.RaisesGroup(pytest.RaisesExc(EngineDead, match="made no progress"), flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                await nursery.start(client.run)
                client.submit_nowait(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=4), 0, 0.0))
                started = trio.current_time()
                try:
                    await trio.sleep_forever()
                finally:
                    assert 2 <= trio.current_time() - started < 30
                    assert client.progress.step_num_tokens == 3 and client.progress.steps_done == 0


def test_a_steps_size_at_the_slowest_rate_seen_raises_its_bound():
    bound = StepBound(timeout=10)
    decode_rate = 0.05  # seconds per token of the slowest finished step
    small = StepProgress(steps_done=7, step_age=11, step_num_tokens=1, slowest_token_seconds=decode_rate)
    assert bound.allowed(small) == 10 and "made no progress in 11 s" in bound.why_stuck(small)
    prefill = StepProgress(steps_done=7, step_age=90, step_num_tokens=2000, slowest_token_seconds=decode_rate)
    assert bound.allowed(prefill) == pytest.approx(1000) and bound.why_stuck(prefill) is None
    idle = StepProgress(steps_done=7)
    assert bound.why_stuck(idle) is None
