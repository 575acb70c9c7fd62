"""--stream-stall-timeout exactly at the bound, on a virtual clock.

A live server cannot show "just under the timeout": the kernel's socket buffers decide when a
reader's output starts to pile up. Here the frontend runs with a stand-in engine client and
trio's MockClock, so the stall starts at a known instant.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tidal.config import ServerConfig
from tidal.registry.frontend import Frontend
from tidal.registry.lifecycle import RequestState
from tidal.observe.metrics import Metrics
from tidal.errors import ApiError
from tidal.wire import EngineConfig, EngineStats, RequestOutput, SamplingParams, StepReport

TIMEOUT = 2.0
WATCH_PERIOD = TIMEOUT / 4  # Frontend.watch_stalls checks every min(1 s, timeout / 4)


class StandInEngine:
    """Records what the frontend asks of the engine."""

    healthy = True
    dead = None

    def __init__(self):
        self.listener = None
        self.submitted: list[int] = []
        self.aborted: list[int] = []

    def attach(self, listener):
        self.listener = listener

    def pick(self, prompt_token_ids):
        return self

    def submit_nowait(self, message):
        self.submitted.append(message.request_id)

    def abort_nowait(self, request_id):
        self.aborted.append(request_id)


def make_frontend(max_buffer: int = 1 << 20) -> tuple[Frontend, StandInEngine]:
    config = ServerConfig(engine=EngineConfig(model="m"), stream_stall_timeout=TIMEOUT,
                          max_stream_buffer_bytes=max_buffer)
    engine = StandInEngine()
    return Frontend(config, engine, Metrics("m"), max_num_seqs=4), engine  # type: ignore[arg-type]


def deliver(engine: StandInEngine, request_id: int, text: str) -> None:
    """What the engine client does with a report of one engine output."""
    report = StepReport(started=[request_id], outputs=[RequestOutput(request_id, [1], text)], finished=[],
                        stats=EngineStats())
    engine.listener.on_report(report, engine)


def slow_client_aborts(frontend: Frontend) -> float:
    return frontend.metrics.registry.get_sample_value(
        "tidal:requests_aborted_total", {"model_name": "m", "reason": "slow_client"}) or 0.0


async def test_output_pending_for_exactly_the_timeout_is_kept_and_past_it_is_aborted(mock_clock):
    frontend, engine = make_frontend()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(frontend.watch_stalls)
        request = frontend.open_request([1, 2, 3], SamplingParams(max_tokens=100), 0)
        deliver(engine, request.request_id, "a")  # the reader takes nothing from here on

        mock_clock.jump(TIMEOUT)  # pending for exactly the timeout
        await trio.testing.wait_all_tasks_blocked()
        assert request.state is RequestState.RUNNING and engine.aborted == []

        mock_clock.jump(WATCH_PERIOD)  # past it: the next check aborts
        await trio.testing.wait_all_tasks_blocked()
        assert request.state is RequestState.ABORTED and request.abort_reason == "slow_client"
        assert engine.aborted == [request.request_id]  # the engine is told to free its blocks
        assert slow_client_aborts(frontend) == 1
        with pytest.raises(ApiError) as info:
            await request.mailbox.take()  # the pending output was dropped; the reader gets the error
        assert info.value.type == "slow_client"
        nursery.cancel_scope.cancel()


async def test_a_reader_that_keeps_taking_is_never_stalled(mock_clock):
    frontend, engine = make_frontend()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(frontend.watch_stalls)
        request = frontend.open_request([1], SamplingParams(max_tokens=100), 0)
        for _ in range(10):  # output arrives and is taken every 0.9 timeouts: 9 timeouts in all
            deliver(engine, request.request_id, "a")
            mock_clock.jump(0.9 * TIMEOUT)
            await trio.testing.wait_all_tasks_blocked()
            request.mailbox.take_nowait()
        assert request.state is RequestState.RUNNING and slow_client_aborts(frontend) == 0

        # no output pending is not a stall either, however long the reader waits
        mock_clock.jump(10 * TIMEOUT)
        await trio.testing.wait_all_tasks_blocked()
        assert request.state is RequestState.RUNNING
        nursery.cancel_scope.cancel()


async def test_past_the_byte_bound_the_request_is_aborted_and_its_place_freed():
    frontend, engine = make_frontend(max_buffer=8)  # "abcd" + 1 token id = 8 bytes
    request = frontend.open_request([1], SamplingParams(max_tokens=100), 0)
    deliver(engine, request.request_id, "abcd")
    assert request.state is RequestState.RUNNING
    deliver(engine, request.request_id, "")  # 4 more bytes undelivered: 12 > 8
    assert request.state is RequestState.ABORTED and request.abort_reason == "slow_client"
    assert engine.aborted == [request.request_id] and slow_client_aborts(frontend) == 1
    assert frontend.active == {} and frontend.requests.num_running == 0  # its admission place is free again
