"""The frontend -> engine channel's bound at N and N+1, with a real engine process that stops reading
(SIGSTOP) and a real pipe between them (tidal/engines/client.py, docs/admission.md #11).

Once the pipe is full the writer task blocks and messages wait in the channel. With the channel
full, the next heartbeat cannot be queued and the engine is declared dead at once (the server then
exits with code 3: tests/cancellation/test_cancel_engine_failure.py), long before the heartbeat
timeout; with one place left the heartbeat's ping takes it and the engine is not declared dead.
"""

from __future__ import annotations

import os
import signal

import pytest
import trio

from tidal.engines.client import EngineClient, EngineDead
from tidal.wire import AddRequest, EngineConfig, SamplingParams

CAPACITY = 8
INTERVAL = 3.0  # the first heartbeat comes this long after Ready: the test fills pipe and channel before
LONG_PROMPT = list(range(100, 4100))  # ~12 KB a message: a few fill the 64 KiB pipe


async def hang_and_fill(client: EngineClient, pid: int, free_places: int) -> None:
    """Stop the engine, fill the pipe until the writer blocks, then the channel up to ``free_places``."""
    os.kill(pid, signal.SIGSTOP)
    request_id = 0
    while client._send.statistics().current_buffer_used == 0:  # the writer still takes what comes
        request_id += 1
        client.submit_nowait(AddRequest(request_id, LONG_PROMPT, SamplingParams(max_tokens=1)))
        await trio.sleep(0.05)
    while client._send.statistics().current_buffer_used < CAPACITY - free_places:
        request_id += 1
        client.submit_nowait(AddRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=1)))
    await trio.sleep(0.2)
    assert client._send.statistics().current_buffer_used == CAPACITY - free_places  # the writer is stuck


class Deaths:
    """The client's listener: when, and why, the engine was declared dead."""

    def __init__(self):
        self.seen: list[tuple[float, str]] = []

    def on_report(self, report, engine) -> None:
        pass

    def on_engine_dead(self, engine, why: str) -> None:
        self.seen.append((trio.current_time(), why))


async def run_hung(free_places: int) -> tuple[list[tuple[float, str]], float]:
    """The deaths the client declared (time since its first heartbeat was due, why) in two heartbeats' time."""
    client = EngineClient(EngineConfig(model="tidal-test", num_kv_blocks=64), channel_capacity=CAPACITY,
                          heartbeat_interval=INTERVAL, heartbeat_timeout=600)
    deaths = Deaths()
    client.attach(deaths)
    pid = None
    try:
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                ready = await nursery.start(client.run)
                pid = ready.pid
                first_heartbeat = trio.current_time() + INTERVAL
                await hang_and_fill(client, pid, free_places)
                assert trio.current_time() < first_heartbeat, "filled too late for this test"
                if free_places == 0:
                    with pytest.raises(trio.WouldBlock):  # the request past the bound is refused at once
                        client.submit_nowait(AddRequest(10_000, [1], SamplingParams(max_tokens=1)))
                await trio.sleep(first_heartbeat + INTERVAL - trio.current_time())
                os.kill(pid, signal.SIGKILL)  # still alive (one place left): end it; the reader sees EOF
    except* EngineDead:
        pass
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return [(when - first_heartbeat, why) for when, why in deaths.seen]


async def test_a_full_channel_declares_the_engine_dead_at_the_next_heartbeat():
    after, why = (await run_hung(free_places=0))[0]
    assert 0 <= after < 10  # at the heartbeat itself (a loaded host may run it late), not after the 600 s timeout
    assert why == f"engine stopped reading its pipe: the frontend -> engine channel is full ({CAPACITY} messages)"


async def test_one_place_left_takes_the_heartbeat_and_the_engine_lives():
    deaths = await run_hung(free_places=1)
    assert all(after >= INTERVAL for after, _ in deaths)  # only our own SIGKILL at the end
