"""Slow clients: the engine never waits for a reader, a stalled reader is aborted after
--stream-stall-timeout, and fifty of them slow down nobody else.

The slow clients are raw sockets with a tiny SO_RCVBUF (set before connect, so the TCP window
stays small) that read one byte a second: the kernel buffers fill within seconds, the server's
send blocks, the request's mailbox merges what the engine keeps producing, and after the stall
timeout the request is aborted and its KV blocks are freed.
"""

from __future__ import annotations

import statistics

import psutil
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

STALL_TIMEOUT = 2.0
MAX_BUFFER = 4096
NUM_SLOW = 50
SLOW_CLIENT = {"message": "The client did not read its stream fast enough (stalled past --stream-stall-timeout); "
                          "the request was aborted.", "type": "slow_client", "param": None, "code": 503}


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--engine-threads", "1", "--max-num-seqs", "64", "--min-step-time", "0.03",
               "--stream-stall-timeout", str(STALL_TIMEOUT), "--max-stream-buffer-bytes", str(MAX_BUFFER))


def rss_bytes(server) -> tuple[int, int]:
    """(frontend RSS, engine RSS) of the live server."""
    return (psutil.Process(server.process.pid).memory_info().rss,
            psutil.Process(server.engine_pid()).memory_info().rss)


async def normal_itls(client, max_tokens: int = 30) -> list[float]:
    r = await stream(client, completion_body(max_tokens))
    assert r.status == 200 and r.usage["completion_tokens"] == max_tokens
    return r.gaps()


async def test_a_stalled_reader_is_aborted_and_its_blocks_freed_while_its_socket_is_open(server):
    m0 = await metrics_async(server)
    t0 = trio.current_time()
    sock = await open_raw(server.port, completion_body(3000), rcvbuf=1024)
    try:
        m = await wait_for_async(server, lambda m: aborted(m, "slow_client") == aborted(m0, "slow_client") + 1,
                                 timeout=30)
        assert trio.current_time() - t0 > STALL_TIMEOUT  # never before the stall timeout
        assert m["tidal:generation_tokens_total"] - m0["tidal:generation_tokens_total"] < 3000  # cut short
        await wait_for_async(server, lambda m: m["tidal:kv_cache_blocks_used"] == 0
                             and m["tidal:frontend_requests_active"] == 0, timeout=10)
        # the client, reading at last, gets a 200 stream that ends with the slow_client error frame
        with trio.fail_after(30):
            answer = parse_raw_sse(await read_response(sock))
    finally:
        await sock.aclose()
    assert answer.status == 200 and answer.chunks
    assert answer.error == SLOW_CLIENT and answer.done
    assert answer.finish_reason is None
    server.wait_idle()


async def read_a_byte_a_second(sock, statuses: list[int]) -> None:
    head = b""
    while not head.endswith(b"\r\n"):  # the status line first, then one byte a second
        head += await sock.receive_some(1)
    statuses.append(int(head.split()[1]))
    while await sock.receive_some(1):
        await trio.sleep(1.0)


async def test_fifty_one_byte_a_second_readers_do_not_slow_other_clients_or_grow_memory(server):
    m0 = await metrics_async(server)
    sockets, statuses, itls_with_slow = [], [], []
    window_s, window_steps = 0.0, 0
    async with async_client(server) as client:
        await normal_itls(client, 5)  # warm up the path
        baseline = [g for _ in range(2) for g in await normal_itls(client)]
        rss0 = rss_bytes(server)
        rss_peak = list(rss0)
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(NUM_SLOW):
                    sockets.append(await open_raw(server.port, completion_body(3000), rcvbuf=1024))
                    nursery.start_soon(read_a_byte_a_second, sockets[-1], statuses)
                await wait_for_async(server, lambda m: m["tidal:num_requests_running"] >= NUM_SLOW, timeout=60)
                with trio.fail_after(120):  # a normal client streams until every slow one is cut off
                    slow_aborted = aborted(m0, "slow_client") + NUM_SLOW
                    while aborted(m := await metrics_async(server), "slow_client") < slow_aborted:
                        started = trio.current_time()
                        itls_with_slow += await normal_itls(client)
                        # the engine's own pace over the same seconds: what the normal client may expect
                        after = await metrics_async(server)
                        window_s += trio.current_time() - started
                        window_steps += after["tidal:engine_steps_total"] - m["tidal:engine_steps_total"]
                        frontend, engine = rss_bytes(server)
                        rss_peak = [max(rss_peak[0], frontend), max(rss_peak[1], engine)]
                # all by the stall bound, every KV block given back, though the sockets are still open
                m = await wait_for_async(server, lambda m: m["tidal:kv_cache_blocks_used"] == 0
                                         and m["tidal:frontend_requests_active"] == 0, timeout=10)
                assert aborted(m, "slow_client") - aborted(m0, "slow_client") == NUM_SLOW
                nursery.cancel_scope.cancel()
        finally:  # a reader that stays connected without reading pins its handler (see docs/admission.md)
            for sock in sockets:
                await sock.aclose()

    assert statuses == [200] * NUM_SLOW
    base, slow = statistics.median(baseline), statistics.median(itls_with_slow)
    step = window_s / window_steps  # the engine's step interval while the normal client streamed
    grown = (rss_peak[0] - rss0[0]) / 2**20, (rss_peak[1] - rss0[1]) / 2**20
    print(f"ITL median {base * 1e3:.1f} ms alone, {slow * 1e3:.1f} ms beside {NUM_SLOW} slow readers, whose "
          f"engine steps took {step * 1e3:.1f} ms; RSS grew {grown[0]:.1f} MiB (frontend), {grown[1]:.1f} MiB (engine)")
    # Against the engine's pace in the same seconds, not against the lone baseline: on a busy host a step
    # of 51 sequences takes longer than a step of one, which is no fault of the slow readers; a client
    # they held back would fall behind the engine's own pace. And the engine never waits for a reader
    # that takes a byte a second: its steps stay far under a second.
    assert step < 0.5, f"engine steps took {step * 1e3:.1f} ms beside the slow readers"
    assert slow < 2 * step + 0.005, f"ITL median {slow * 1e3:.1f} ms with slow readers vs steps of {step * 1e3:.1f} ms"
    # what a slow reader may cost the server is bounded (mailbox bytes, not a backlog of frames)
    assert grown[0] < 32 and grown[1] < 64, f"RSS grew by {grown[0]:.1f} MiB (frontend), {grown[1]:.1f} (engine)"
    server.wait_idle()
