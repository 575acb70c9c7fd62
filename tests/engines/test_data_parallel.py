"""``--data-parallel-size 2``: two engine processes behind one frontend, as a user sees them.

Rules for determinism: every forward pass lasts at least 50 ms (``--min-step-time``), so a stream
asked for 200 tokens is certainly still running while the test looks; streams are opened one at a
time and each reads its first chunk before the next opens, so routing sees them in that order;
prompts are random token ids no other request shares unless the test means them to.
"""

from __future__ import annotations

import json
import os
import signal

import psutil
import pytest
import trio
from admission.admission_clients import StreamResult, async_client, stream
from cancellation.cancel_helpers import RawHttp, completion_body, poll, scrape, scrape_health, unique_prompt
from live_server import LiveServer

pytestmark = pytest.mark.slow
FLAGS = ("--data-parallel-size", "2", "--min-step-time", "0.05", "--num-kv-blocks", "256",
         "--tokenizer-workers", "1")
BLOCK = 16


def per_replica(m: dict[str, float], name: str, **labels: str) -> list[float]:
    def key(replica: str) -> str:
        full = {"model_name": "tidal-tiny", "replica": replica, **labels}
        return name + "{" + ",".join(f'{k}="{full[k]}"' for k in sorted(full)) + "}"
    return [m.get(key(r), 0.0) for r in ("0", "1")]


def open_streams(server, prompts: list[list[int]], max_tokens: int = 200) -> list[RawHttp]:
    streams = []
    for prompt in prompts:
        stream = RawHttp(server.port, "/v1/completions", completion_body(prompt, max_tokens))
        stream.next_chunk()  # admitted, routed and running before the next one arrives
        streams.append(stream)
    return streams


def engine_pids(server) -> list[int]:
    children = psutil.Process(server.process.pid).children()
    return sorted(c.pid for c in children if "tidal.gpu" in " ".join(c.cmdline()))


def finish_reasons(events: list[str]) -> list:
    return [json.loads(e).get("choices", [{}])[0].get("finish_reason") for e in events[:-1]]


@pytest.fixture(scope="module")
def dp_server():
    """Shared: the spread test disturbs nothing; the killed-replica test (after it) counts its own."""
    with LiveServer(*FLAGS) as server:
        yield server


def test_concurrent_requests_spread_and_shared_prefixes_stay_together(dp_server):
    server = dp_server
    assert len(engine_pids(server)) == 2
    streams = open_streams(server, [unique_prompt(8, seed=100 + i) for i in range(6)])
    m = poll(server, lambda m: per_replica(m, "tidal:replica_num_requests_running") == [3, 3])
    assert per_replica(m, "tidal:requests_routed_total", reason="load") == [3, 3]
    assert m["tidal:num_requests_running"] == 6 and m["tidal:replicas_live"] == 2
    for stream in streams:
        stream.close()
    poll(server, lambda m: m["tidal:kv_cache_blocks_used"] == 0)

    # Two 64-token prefixes, first seen on different replicas (B arrives while A runs).
    prefix_a, prefix_b = unique_prompt(4 * BLOCK, seed=1), unique_prompt(4 * BLOCK, seed=2)
    firsts = open_streams(server, [prefix_a + [11, 12], prefix_b + [11, 12]], max_tokens=4)
    for stream in firsts:
        assert stream.rest_of_stream()[-1] == "[DONE]"
        stream.close()
    # Then three more of each, all at once, A's first: plain least-loaded routing would split them.
    bodies = [completion_body(prefix + [20 + i, 21], 4, stream=False)
              for prefix in (prefix_a, prefix_b) for i in range(3)]
    clients = [RawHttp(server.port, "/v1/completions", body) for body in bodies]
    cached = []
    for client in clients:
        assert client.read_head() == 200
        cached.append(client.read_json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        client.close()
    assert cached == [4 * BLOCK] * 6  # every one found its prefix in the replica it was sent to
    m = scrape(server)
    assert sum(per_replica(m, "tidal:requests_routed_total", reason="prefix")) == 6
    assert all(hits >= 3 * 4 * BLOCK for hits in per_replica(m, "tidal:replica_prefix_cache_hit_tokens"))


def test_a_killed_replica_fails_only_its_streams_and_is_replaced(dp_server):
    server = dp_server
    streams = open_streams(server, [unique_prompt(8, seed=200 + i) for i in range(4)], max_tokens=60)
    poll(server, lambda m: per_replica(m, "tidal:replica_num_requests_running") == [2, 2])
    old_pids = engine_pids(server)
    os.kill(old_pids[0], signal.SIGKILL)

    outcomes = []
    for stream in streams:
        events = stream.rest_of_stream()
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["type"] == "engine_error" and last["error"]["code"] == 503
            assert last["error"]["message"].startswith("The engine is not available")
            outcomes.append("error")
        else:
            assert finish_reasons(events)[-1] == "length"
            outcomes.append("finished")
        stream.close()
    assert sorted(outcomes) == ["error", "error", "finished", "finished"]

    # the other replica kept serving; the dead one comes back after its backoff
    m = scrape(server)
    assert scrape_health(server) == 200 and server.process.poll() is None
    assert m["tidal:replicas_live"] in (1, 2)
    ok = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=300), 4, stream=False))
    assert ok.read_head() == 200 and ok.read_json()["usage"]["completion_tokens"] == 4
    ok.close()
    m = poll(server, lambda m: m["tidal:replicas_live"] == 2, timeout=60)
    assert sum(per_replica(m, "tidal:replica_restarts")) == 1
    new_pids = engine_pids(server)
    assert len(new_pids) == 2 and old_pids[0] not in new_pids and old_pids[1] in new_pids

    # both serve again, and afterwards every KV block is free on both
    before = per_replica(scrape(server), "tidal:requests_routed_total", reason="load")
    streams = open_streams(server, [unique_prompt(8, seed=400 + i) for i in range(4)], max_tokens=20)
    after = per_replica(scrape(server), "tidal:requests_routed_total", reason="load")
    assert [a - b for a, b in zip(after, before)] == [2, 2]
    for stream in streams:
        assert finish_reasons(stream.rest_of_stream())[-1] == "length"
        stream.close()
    m = poll(server, lambda m: m["tidal:kv_cache_blocks_used"] == 0)
    assert per_replica(m, "tidal:replica_kv_cache_usage_perc") == [0.0, 0.0]
    assert m["tidal:requests_aborted_total{model_name=\"tidal-tiny\",reason=\"engine_error\"}"] == 2


def test_one_replica_with_restarts_comes_back_instead_of_exiting():
    with LiveServer("--engine-restarts", "1", "--min-step-time", "0.05", "--num-kv-blocks", "128") as server:
        (pid,) = engine_pids(server)
        os.kill(pid, signal.SIGKILL)
        poll(server, lambda m: m["tidal:replicas_live"] == 0)
        assert scrape_health(server) == 503  # no replica serves while it restarts
        poll(server, lambda m: m["tidal:replicas_live"] == 1, timeout=60)
        assert scrape_health(server) == 200 and engine_pids(server) != [pid]
        ok = RawHttp(server.port, "/v1/completions", completion_body(unique_prompt(8, seed=500), 4, stream=False))
        assert ok.read_head() == 200
        ok.close()


async def test_the_admission_bound_is_global_over_the_replicas():
    """Two replicas of two slots each and two queue places: six in flight, the seventh refused."""
    with LiveServer("--data-parallel-size", "2", "--max-num-seqs", "2", "--max-queued-requests", "2",
                    "--min-step-time", "0.05", "--num-kv-blocks", "128") as server:
        results = [StreamResult() for _ in range(12)]
        async with async_client(server) as client, trio.open_nursery() as nursery:
            for r in results:
                nursery.start_soon(stream, client, completion_body(unique_prompt(8, seed=700), 30),
                                   "/v1/completions", r)
        statuses = sorted(r.status for r in results)
        assert statuses == [200] * 6 + [503] * 6
        assert all(r.finish_reason == "length" for r in results if r.status == 200)
        m = server.wait_idle()
        assert per_replica(m, "tidal:requests_routed_total", reason="load") == [3, 3]


def test_a_hung_replica_is_killed_and_replaced_while_the_other_serves():
    """SIGSTOP one replica: no heartbeat answer within 2 s, so it is killed, its streams fail, it restarts."""
    with LiveServer(*FLAGS, "--engine-heartbeat-timeout", "2") as server:
        streams = open_streams(server, [unique_prompt(8, seed=800 + i) for i in range(2)], max_tokens=200)
        poll(server, lambda m: per_replica(m, "tidal:replica_num_requests_running") == [1, 1])
        hung, other = engine_pids(server)
        os.kill(hung, signal.SIGSTOP)
        ends = []
        for stream in streams:
            last = json.loads(stream.rest_of_stream()[-2])
            ends.append("error" if "error" in last else last["choices"][0]["finish_reason"])
            stream.close()
        assert sorted(ends) == ["error", "length"]  # the other replica's stream ran to its end
        m = poll(server, lambda m: m["tidal:replicas_live"] == 2, timeout=60)
        assert sum(per_replica(m, "tidal:replica_restarts")) == 1
        assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
        assert other in engine_pids(server) and scrape_health(server) == 200
