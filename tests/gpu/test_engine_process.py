"""The engine as a child process, driven through its pipes with the wire protocol, and
through the frontend's EngineClient: start, serve, abort mid-step, clean shutdown, death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import trio

from tidal.engines.client import EngineClient, EngineDead
from tidal.wire import (
    AbortRequests,
    AddRequest,
    EngineConfig,
    EngineFailed,
    FrameSplitter,
    Ping,
    Pong,
    Ready,
    SamplingParams,
    Shutdown,
    StepReport,
    decode_from_engine,
    encode_frame,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


class Child:
    """A raw engine process and a blocking frame reader."""

    def __init__(self, config: EngineConfig):
        self.proc = subprocess.Popen([sys.executable, "-m", "tidal.gpu"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self.splitter = FrameSplitter()
        self.pending: list = []
        self.send(config)

    def send(self, message) -> None:
        self.proc.stdin.write(encode_frame(message))
        self.proc.stdin.flush()

    def receive(self, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while not self.pending:
            assert time.monotonic() < deadline, "no frame from the engine in time"
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not data:
                return None  # EOF
            self.pending.extend(decode_from_engine(b) for b in self.splitter.feed(data))
        return self.pending.pop(0)

    def receive_until(self, predicate, timeout: float = 60.0) -> list:
        seen = []
        while True:
            message = self.receive(timeout)
            assert message is not None, f"EOF while waiting; saw {seen}"
            seen.append(message)
            if predicate(message):
                return seen


def test_serve_abort_mid_step_and_clean_shutdown():
    child = Child(EngineConfig(model="tidal-tiny", min_step_time=0.3, num_kv_blocks=64))
    try:
        ready = child.receive()
        assert isinstance(ready, Ready) and ready.num_total_blocks == 64 and ready.pid == child.proc.pid
        child.send(AddRequest(1, [5, 6, 7, 8], GREEDY, 0, 0.0))
        first = child.receive_until(lambda m: isinstance(m, StepReport) and m.outputs)[-1]
        assert first.started == [1] and first.outputs[0].request_id == 1
        assert first.stats.num_used_blocks == 1
        steps_before = first.stats.step
        time.sleep(0.1)  # now inside the next 0.3 s forward pass
        child.send(AbortRequests([1]))
        report = child.receive_until(lambda m: isinstance(m, StepReport) and 1 in m.finished)[-1]
        assert report.stats.num_used_blocks == 0
        assert report.stats.step == steps_before + 1, "freed at the end of the step it arrived in"
        assert all(o.request_id != 1 for o in report.outputs), "the aborted request's token is dropped"
        child.send(AbortRequests([1, 12345]))  # already gone, unknown: no-ops
        child.send(Ping(7))
        pong = child.receive_until(lambda m: isinstance(m, Pong))[-1]
        assert pong.nonce == 7 and pong.stats.num_used_blocks == 0 and pong.stats.num_running == 0
        child.send(Shutdown())
        assert child.proc.wait(30) == 0
    finally:
        child.proc.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="timer slack is a Linux setting")
def test_engine_process_runs_with_a_tight_timer_slack():
    """The engine's waits (a min_step_time pass, the step loop waiting for a pass) end on time:
    the process asks Linux for a 1 ns timer slack instead of the default 50 us."""
    child = Child(EngineConfig(model="tidal-test"))
    try:
        ready = child.receive()
        assert isinstance(ready, Ready)
        with open(f"/proc/{ready.pid}/timerslack_ns") as f:
            assert int(f.read()) == 1
        child.send(Shutdown())
        assert child.proc.wait(30) == 0
    finally:
        child.proc.kill()


def test_timer_slack_is_left_alone_off_linux(monkeypatch):
    from tidal.gpu import process

    monkeypatch.setattr(process.sys, "platform", "darwin")
    assert process.tighten_timer_slack() is False  # and no prctl call, which would fail there


def test_startup_failure_is_reported():
    child = Child(EngineConfig(model="/nonexistent/model/dir"))
    message = child.receive()
    assert isinstance(message, EngineFailed) and "nonexistent" in message.message
    assert child.proc.wait(30) != 0


def test_closing_stdin_stops_the_engine():
    child = Child(EngineConfig(model="tidal-tiny"))
    assert isinstance(child.receive(), Ready)
    child.send(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=1000), 0, 0.0))
    child.proc.stdin.close()  # the frontend vanished
    assert child.proc.wait(30) == 0


class RecordingListener:
    """The frontend's side of the engine client's door, recorded."""

    def __init__(self):
        self.started: list[int] = []
        self.first_output = trio.Event()
        self.dead = trio.Event()
        self.why = ""
        self.engine = None

    def on_report(self, report, engine):
        self.started += report.started
        if report.outputs:
            self.first_output.set()

    def on_engine_dead(self, engine, why):
        self.engine, self.why = engine, why
        self.dead.set()


async def test_engine_client_tells_its_listener_when_the_engine_dies():
    client = EngineClient(EngineConfig(model="tidal-tiny", min_step_time=0.05), channel_capacity=64,
                          heartbeat_interval=0.2, heartbeat_timeout=5)
    listener = RecordingListener()
    client.attach(listener)
    with trio.fail_after(60):
        with pytest.RaisesGroup(pytest.RaisesExc(EngineDead, match="exited"), flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                ready = await nursery.start(client.run)
                client.submit_nowait(AddRequest(1, [5, 6, 7], SamplingParams(max_tokens=1000), 0, 0.0))
                await listener.first_output.wait()
                assert listener.started == [1] and client.healthy
                os.kill(ready.pid, signal.SIGKILL)
                await listener.dead.wait()  # told at once, with the reason
                assert "exited" in listener.why and listener.engine is client
                assert not client.healthy
                await trio.sleep_forever()  # run() raises EngineDead and ends the nursery


async def test_engine_client_detects_a_hung_engine():
    client = EngineClient(EngineConfig(model="tidal-tiny"), channel_capacity=64,
                          heartbeat_interval=0.1, heartbeat_timeout=0.5)
    with trio.fail_after(60):
        with pytest.RaisesGroup(EngineDead, flatten_subgroups=True):
            async with trio.open_nursery() as nursery:
                ready = await nursery.start(client.run)
                assert await client.ping(timeout=5) is not None
                os.kill(ready.pid, signal.SIGSTOP)  # alive but not answering
                try:
                    await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        assert "heartbeat" in (client.dead or "")


@pytest.mark.parametrize("attempt", range(3))
def test_shutdown_right_after_ready_exits_cleanly(attempt):
    """Shut down while the grammar compiler is still being built on its start-up thread (native
    code): the engine exits 0, not with an abort from the interpreter's teardown under that thread."""
    child = Child(EngineConfig(model="tidal-tiny", num_kv_blocks=64))
    try:
        assert isinstance(child.receive(), Ready)
        child.send(Shutdown())
        assert child.proc.wait(30) == 0
    finally:
        child.proc.kill()
