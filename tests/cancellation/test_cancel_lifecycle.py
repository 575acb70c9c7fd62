"""The frontend's request state table and ``Frontend.close``, without a server.

The table (tidal/registry/lifecycle.py) is what makes an abort idempotent: a request ends exactly
once, and every later ``close``/``abort`` sees a final state and does nothing. ``close``
is called from already-cancelled code (a disconnected handler's cleanup), so it must get
the abort to the engine without awaiting anything.
"""

from __future__ import annotations

import itertools

import pytest
import trio

from engines.single_engine import SingleEngine
from tidal.config import ServerConfig
from tidal.engines.client import EngineClient
from tidal.registry.frontend import Frontend
from tidal.registry.lifecycle import ActiveRequest, IllegalTransition, RequestState
from tidal.registry.mailbox import Mailbox
from tidal.observe.metrics import Metrics
from tidal.errors import ApiError
from tidal.wire import (HEADER_SIZE, AbortRequests, AddRequest, EngineConfig, EngineStats, RequestOutput,
                        SamplingParams, StepReport, decode_to_engine)

Q, RUN, FIN, ABT, REJ = (RequestState.QUEUED, RequestState.RUNNING, RequestState.FINISHED, RequestState.ABORTED,
                         RequestState.REJECTED)
# The documented lifecycle (tidal/registry/lifecycle.py); every other move is a bug in the caller.
LEGAL = {(Q, RUN), (Q, FIN), (Q, ABT), (Q, REJ), (RUN, FIN), (RUN, ABT)}


def _request(state: RequestState) -> ActiveRequest:
    return ActiveRequest(request_id=1, priority=0, arrival_time=0.0, num_prompt_tokens=3,
                         params=SamplingParams(max_tokens=4), mailbox=Mailbox(1 << 10), state=state)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(RequestState, repeat=2)),
                         ids=lambda s: s.value)
async def test_transition_table(old, new):
    request = _request(old)
    if (old, new) in LEGAL:
        request.move_to(new)
        assert request.state is new
    else:
        with pytest.raises(IllegalTransition):
            request.move_to(new)
        assert request.state is old  # a refused move changes nothing


async def test_final_states_are_exactly_the_ends():
    assert {s for s in RequestState if _request(s).is_final} == {FIN, ABT, REJ}


# ------------------------------------------------------------------ Frontend.close


def _frontend() -> tuple[Frontend, EngineClient]:
    config = ServerConfig(engine=EngineConfig(model="tidal-tiny"))
    engine = EngineClient(config.engine, channel_capacity=64)
    engine.ready = object()  # type: ignore[assignment]  # healthy; no process: messages stay in the channel
    return Frontend(config, SingleEngine(engine), Metrics("tidal-tiny"), max_num_seqs=4), engine  # type: ignore[arg-type]


def _sent(engine: EngineClient) -> list:
    """What the writer task would send to the engine next (the callers encoded each frame)."""
    messages = []
    while True:
        try:
            messages.append(decode_to_engine(engine._receive.receive_nowait()[HEADER_SIZE:]))
        except trio.WouldBlock:
            return messages


def _aborts(frontend: Frontend, reason: str) -> float:
    return frontend.metrics.registry.get_sample_value(
        "tidal:requests_aborted_total", {"model_name": "tidal-tiny", "reason": reason}) or 0.0


async def test_close_from_a_cancelled_scope_reaches_the_engine_once():
    frontend, engine = _frontend()
    request = frontend.open_request([1, 2, 3], SamplingParams(max_tokens=4), 0)
    assert [type(m) for m in _sent(engine)] == [AddRequest]
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.sleep_forever()
        finally:  # what a disconnected handler's cleanup runs: already cancelled, no await
            frontend.close(request)
            frontend.close(request)
    assert _sent(engine) == [AbortRequests([request.request_id])]
    assert request.state is ABT and not frontend.active
    assert _aborts(frontend, "client_disconnect") == 1


async def test_close_after_the_engine_finished_is_a_noop():
    frontend, engine = _frontend()
    request = frontend.open_request([1, 2, 3], SamplingParams(max_tokens=1), 0)
    rid = request.request_id
    _sent(engine)
    engine._handle(StepReport(started=[rid], outputs=[RequestOutput(rid, [7], "x", "length")], finished=[rid],
                              stats=EngineStats()))
    assert request.state is FIN
    frontend.close(request)
    assert _sent(engine) == []  # the engine already forgot it: nothing to abort
    assert _aborts(frontend, "client_disconnect") == 0
    assert not frontend.active


# ------------------------------------------------------------------ the table's counts, and every ending


def _report(started=(), outputs=()) -> StepReport:
    return StepReport(started=list(started), outputs=list(outputs), finished=[], stats=EngineStats())


async def test_queued_and_running_counts_follow_the_transitions():
    frontend, engine = _frontend()
    table = frontend.requests
    a, b = (frontend.open_request([1, 2], SamplingParams(max_tokens=2), 0) for _ in range(2))
    assert (table.num_queued, table.num_running) == (2, 0)
    engine._handle(_report(started=[a.request_id]))
    assert (table.num_queued, table.num_running) == (1, 1)
    engine._handle(_report(outputs=[RequestOutput(a.request_id, [7], "x", "length")]))
    assert (table.num_queued, table.num_running) == (1, 0) and a.state is FIN
    frontend.close(b)
    assert (table.num_queued, table.num_running) == (0, 0) and frontend.active == {}


async def test_engine_death_ends_every_request_through_its_mailbox():
    frontend, engine = _frontend()
    running = frontend.open_request([1, 2], SamplingParams(max_tokens=8), 0)
    queued = frontend.open_request([1, 2], SamplingParams(max_tokens=8), 0)
    _sent(engine)
    engine._handle(_report(started=[running.request_id], outputs=[RequestOutput(running.request_id, [7], "x")]))
    engine._fail("engine process exited (code -9)")
    assert running.state is ABT and queued.state is ABT and not frontend.active
    assert _sent(engine) == []  # nobody is left to tell
    assert _aborts(frontend, "engine_error") == 2
    assert (await running.mailbox.take()).text == "x"  # what was already produced comes first
    for request in (running, queued):
        with pytest.raises(ApiError) as info:
            await request.mailbox.take()
        assert info.value.status == 503 and info.value.type == "engine_error"
        assert "engine process exited" in info.value.message


async def test_shutdown_refuses_queued_requests_and_ends_running_streams_with_abort():
    frontend, engine = _frontend()
    running = frontend.open_request([1, 2], SamplingParams(max_tokens=8), 0)
    queued = frontend.open_request([1, 2], SamplingParams(max_tokens=8), 0)
    _sent(engine)
    engine._handle(_report(started=[running.request_id]))
    await frontend.drain(0)
    assert running.state is ABT and queued.state is REJ and not frontend.active
    assert _sent(engine) == [AbortRequests([running.request_id]), AbortRequests([queued.request_id])]
    final = await running.mailbox.take()
    assert final.finish_reason == "abort" and final.text == ""
    with pytest.raises(ApiError) as info:
        await queued.mailbox.take()
    assert info.value.status == 503 and info.value.message == "The server is shutting down."
