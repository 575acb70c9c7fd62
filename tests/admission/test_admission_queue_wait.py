"""--max-queue-wait: a request not scheduled within the wait gets a 503; one scheduled in time
is never cut short, however long its generation takes.

One engine slot; a "holder" request occupies it until the test lets it go, so how long the
next request waits is decided by the test, not by the machine's speed.
"""

from __future__ import annotations

import trio

from admission_clients import (
    StreamResult,
    async_client,
    completion_body,
    metrics_async,
    rejected,
    stream,
    wait_for_async,
)

MAX_QUEUE_WAIT = 1.5
TIMEOUT = {"message": "Request waiting timeout reached.", "type": "service_unavailable", "param": None,
           "code": 503}


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--engine-threads", "1", "--max-num-seqs", "1", "--max-queue-wait", str(MAX_QUEUE_WAIT),
               "--min-step-time", "0.05")


async def hold_slot_for(server, client, nursery, seconds: float) -> StreamResult:
    """Occupy the only engine slot with a long request and let it go after ``seconds``."""
    holder = StreamResult()

    async def run():
        with trio.move_on_after(seconds):
            await stream(client, completion_body(1000), "/v1/completions", holder)

    nursery.start_soon(run)
    await wait_for_async(server, lambda m: m["tidal:num_requests_running"] == 1)
    return holder


async def test_requests_waiting_past_the_limit_get_503(server):
    before = rejected(await metrics_async(server), "queue_timeout")
    async with async_client(server) as client, trio.open_nursery() as nursery:
        await hold_slot_for(server, client, nursery, MAX_QUEUE_WAIT + 4)
        streaming, plain = StreamResult(), StreamResult()
        nursery.start_soon(stream, client, completion_body(5), "/v1/completions", streaming)
        nursery.start_soon(stream, client, {**completion_body(5), "stream": False}, "/v1/completions", plain)
        with trio.fail_after(MAX_QUEUE_WAIT + 3.5):
            await streaming.ended.wait()
            await plain.ended.wait()
        for r in (streaming, plain):
            assert r.status == 503
            assert r.headers["retry-after"] == "1"
            assert r.error == TIMEOUT and not r.chunks
            assert r.answered_at - r.sent_at >= MAX_QUEUE_WAIT - 0.1  # not before the limit
        m = await metrics_async(server)
        assert rejected(m, "queue_timeout") - before == 2
        # the engine forgot them too: only the holder is left
        assert m["tidal:frontend_requests_active"] == 1
        await wait_for_async(server, lambda m: m["tidal:num_requests_waiting"] == 0, timeout=5)
        nursery.cancel_scope.cancel()  # let the holder go
    server.wait_idle()


async def test_bound_scheduled_just_before_the_limit_is_served(server):
    """Waits ~1/3 of the limit: served in full; a request waiting past the limit is the test above."""
    before = rejected(await metrics_async(server), "queue_timeout")
    async with async_client(server) as client, trio.open_nursery() as nursery:
        await hold_slot_for(server, client, nursery, MAX_QUEUE_WAIT / 3)
        r = await stream(client, completion_body(5))
    assert r.status == 200 and r.usage["completion_tokens"] == 5
    assert r.first_chunk_at - r.sent_at < MAX_QUEUE_WAIT + 1.0
    assert rejected(await metrics_async(server), "queue_timeout") == before
    server.wait_idle()


async def test_generation_longer_than_the_wait_is_not_cut_short(server):
    before = rejected(await metrics_async(server), "queue_timeout")
    async with async_client(server) as client:
        r = await stream(client, completion_body(50))  # >= 2.5 s of steps, scheduled at once
    assert r.status == 200 and r.error is None and r.done
    assert r.usage["completion_tokens"] == 50 and r.finish_reason == "length"
    assert r.chunk_times[-1] - r.sent_at > MAX_QUEUE_WAIT
    assert rejected(await metrics_async(server), "queue_timeout") == before
    server.wait_idle()



async def test_a_choice_queued_past_the_limit_ends_the_stream_with_the_timeout(server):
    """n=2 on one engine slot: choice 1 waits while choice 0 generates (>= 2.5 s of steps), past the
    limit. As without stream (a 503), it is refused: choice 0's tokens, then the timeout's error."""
    before = rejected(await metrics_async(server), "queue_timeout")
    async with async_client(server) as client:
        with trio.fail_after(MAX_QUEUE_WAIT + 10):
            r = await stream(client, completion_body(50, n=2))
            plain = await stream(client, {**completion_body(50, n=2), "stream": False})
    assert r.status == 200 and r.error == TIMEOUT and r.usage is None
    assert r.chunks and {chunk["choices"][0]["index"] for chunk in r.chunks} == {0}
    assert r.chunk_times[-1] - r.sent_at < MAX_QUEUE_WAIT + 2.0  # not after choice 0 ran to its end
    assert plain.status == 503 and plain.error == TIMEOUT
    assert rejected(await metrics_async(server), "queue_timeout") - before == 2
    server.wait_idle()
