"""--scheduling-policy priority: lower ``priority`` values are served first, and a more urgent
arrival at a full queue evicts the least urgent waiting request (503), never a running one.

One server with one engine slot and three queue places, so the waiting order is visible in
the order the requests' first tokens arrive.
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

MAX_QUEUED = 3
EVICTED = {"message": "The request is aborted by a higher priority request.", "type": "service_unavailable",
           "param": None, "code": 503}
QUEUE_FULL = {"message": "The request queue is full.", "type": "service_unavailable", "param": None,
              "code": 503}


# this module's server; conftest.py starts it alongside the other modules' servers
SERVER_ARGS = ("--engine-threads", "1", "--scheduling-policy", "priority", "--max-num-seqs", "1",
               "--max-queued-requests", str(MAX_QUEUED), "--min-step-time", "0.05")


def in_flight(m: dict[str, float]) -> float:
    return m["tidal:frontend_requests_active"]


class Holder:
    """A long request that occupies the only engine slot until ``release``."""

    def __init__(self, client):
        self.client = client
        self.scope = trio.CancelScope()
        self.result = StreamResult()

    async def run(self) -> None:
        with self.scope:
            await stream(self.client, completion_body(400, priority=0), "/v1/completions", self.result)

    def release(self) -> None:
        self.scope.cancel()


async def test_waiting_requests_start_in_priority_order(server):
    async with async_client(server) as client, trio.open_nursery() as nursery:
        holder = Holder(client)
        nursery.start_soon(holder.run)
        await wait_for_async(server, lambda m: m["tidal:num_requests_running"] == 1)
        results = {}
        for n, priority in enumerate([5, 1, 3], start=2):  # queued in this order...
            results[priority] = StreamResult()
            nursery.start_soon(stream, client, completion_body(6, priority=priority), "/v1/completions",
                               results[priority])
            await wait_for_async(server, lambda m, n=n: in_flight(m) == n)
        await wait_for_async(server, lambda m: m["tidal:num_requests_waiting"] == 3)
        holder.release()
    for r in results.values():
        assert r.status == 200 and r.usage["completion_tokens"] == 6
    started = sorted(results, key=lambda p: results[p].first_chunk_at)
    assert started == [1, 3, 5]  # ...and started most urgent first
    server.wait_idle()


async def test_urgent_arrival_at_a_full_queue_evicts_the_least_urgent_waiting_request(server):
    m0 = await metrics_async(server)
    async with async_client(server) as client, trio.open_nursery() as nursery:
        holder = Holder(client)
        nursery.start_soon(holder.run)
        await wait_for_async(server, lambda m: m["tidal:num_requests_running"] == 1)
        waiting = {}
        for n, priority in enumerate([2, 6, 4], start=2):
            waiting[priority] = StreamResult()
            nursery.start_soon(stream, client, completion_body(4, priority=priority), "/v1/completions",
                               waiting[priority])
            await wait_for_async(server, lambda m, n=n: in_flight(m) == n)

        # at the bound: an arrival exactly as urgent as the least urgent waiter does not evict it
        # (equal priorities stay first come, first served), and a less urgent one is refused too
        for priority in (6, 10):
            refused = await client.post("/v1/completions", json={**completion_body(4, priority=priority),
                                                                  "stream": False})
            assert refused.status_code == 503
            assert refused.json() == {"error": QUEUE_FULL}
        m = await metrics_async(server)
        assert rejected(m, "queue_full") - rejected(m0, "queue_full") == 2
        assert rejected(m, "preempted_by_priority") == rejected(m0, "preempted_by_priority")

        # one step more urgent: the priority-6 waiter is evicted with a 503, the newcomer takes its place
        waiting[3] = StreamResult()
        nursery.start_soon(stream, client, completion_body(4, priority=3), "/v1/completions", waiting[3])
        with trio.fail_after(10):
            await waiting[6].ended.wait()
        evicted = waiting[6]
        assert evicted.status == 503
        assert evicted.headers["retry-after"] == "1"
        assert evicted.error == EVICTED and not evicted.chunks
        m = await wait_for_async(server, lambda m: in_flight(m) == 4)
        assert rejected(m, "preempted_by_priority") - rejected(m0, "preempted_by_priority") == 1
        assert holder.result.status == 200 and not holder.result.done  # the running request is untouched
        holder.release()

    for priority in (2, 3, 4):
        assert waiting[priority].status == 200 and waiting[priority].usage["completion_tokens"] == 4
    assert sorted((2, 3, 4), key=lambda p: waiting[p].first_chunk_at) == [2, 3, 4]
    server.wait_idle()
