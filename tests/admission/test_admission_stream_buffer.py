"""--max-stream-buffer-bytes: a reader that falls behind gets merged frames and loses nothing;
one that falls behind by more than the bound is aborted as a slow client.

The stall timeout is long here (30 s), so only the byte bound can cut a request off.
Generation is fast (5 ms steps) so that a reader can fall behind within a second or two.
"""

from __future__ import annotations

import trio

from admission_clients import (
    aborted,
    async_client,
    completion_body,
    metrics_async,
    open_raw,
    parse_raw_sse,
    read_response,
    stream,
    wait_for_async,
)

MAX_BUFFER = 4096
STALL_TIMEOUT = 30.0
OVERFLOW = {"message": "The client did not read its stream fast enough (more than --max-stream-buffer-bytes "
                       "undelivered); the request was aborted.", "type": "slow_client", "param": None, "code": 503}


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--engine-threads", "1", "--max-num-seqs", "8", "--min-step-time", "0.005",
               "--stream-stall-timeout", str(STALL_TIMEOUT), "--max-stream-buffer-bytes", str(MAX_BUFFER))


async def test_a_reader_that_falls_behind_gets_merged_frames_and_loses_no_token(server):
    async with async_client(server) as client:
        fast = await stream(client, completion_body(400))
    assert fast.status == 200 and fast.usage["completion_tokens"] == 400

    m0 = await metrics_async(server)
    sock = await open_raw(server.port, completion_body(400), rcvbuf=1024)
    try:
        # Read nothing until the engine has produced 250 tokens: ~50 KB of one-token frames, more
        # than the socket buffers hold, so the rest waits in the mailbox; but at most 250 x ~7 bytes
        # of it, well under the bound. Then read as fast as possible.
        await wait_for_async(server, lambda m: m["tidal:generation_tokens_total"]
                             >= m0["tidal:generation_tokens_total"] + 250, timeout=30)
        with trio.fail_after(30):
            slow = parse_raw_sse(await read_response(sock))
    finally:
        await sock.aclose()
    m = await metrics_async(server)

    assert slow.status == 200 and slow.error is None and slow.done
    assert slow.usage == fast.usage
    assert slow.text == fast.text  # the same greedy completion, every token of it
    assert slow.finish_reason == "length"
    assert len(slow.chunks) < 400  # fewer, bigger frames, and the merges are counted: at most one per
    # token that did not get a frame of its own (the engine's outbox may have merged a few already)
    merged = m["tidal:stream_coalesced_chunks_total"] - m0["tidal:stream_coalesced_chunks_total"]
    assert 0 < merged <= 400 - len(slow.chunks)
    assert aborted(m, "slow_client") == aborted(m0, "slow_client")
    server.wait_idle()


async def test_a_reader_behind_by_more_than_the_bound_is_aborted_and_its_blocks_freed(server):
    m0 = await metrics_async(server)
    t0 = trio.current_time()
    sock = await open_raw(server.port, completion_body(3000), rcvbuf=1024)  # and never reads
    try:
        m = await wait_for_async(server, lambda m: aborted(m, "slow_client") == aborted(m0, "slow_client") + 1,
                                 timeout=STALL_TIMEOUT - 5)
        assert trio.current_time() - t0 < STALL_TIMEOUT  # the byte bound, not the stall timeout
        assert m["tidal:generation_tokens_total"] - m0["tidal:generation_tokens_total"] < 3000
        await wait_for_async(server, lambda m: m["tidal:kv_cache_blocks_used"] == 0
                             and m["tidal:frontend_requests_active"] == 0, timeout=10)
        with trio.fail_after(30):
            answer = parse_raw_sse(await read_response(sock))
    finally:
        await sock.aclose()
    assert answer.status == 200 and answer.chunks and answer.done
    assert answer.error == OVERFLOW
    server.wait_idle()


async def test_a_paused_reader_whose_output_fits_the_bound_is_served_in_full(server):
    """60 tokens are ~500 bytes of mailbox at most: below the bound, so any pause short of the stall
    timeout is harmless."""
    m0 = await metrics_async(server)
    sock = await open_raw(server.port, completion_body(60), rcvbuf=1024)
    try:
        # paused until well after the engine finished: its last report has freed the request's blocks
        await wait_for_async(server, lambda m: m["tidal:generation_tokens_total"]
                             >= m0["tidal:generation_tokens_total"] + 60
                             and m["tidal:num_requests_running"] == 0 and m["tidal:kv_cache_blocks_used"] == 0,
                             timeout=30)
        with trio.fail_after(30):
            answer = parse_raw_sse(await read_response(sock))
    finally:
        await sock.aclose()
    assert answer.status == 200 and answer.error is None and answer.done
    assert answer.usage["completion_tokens"] == 60 and answer.finish_reason == "length"
    assert aborted(await metrics_async(server), "slow_client") == aborted(m0, "slow_client")
    server.wait_idle()
