"""The data-parallel routing policy (tidal/engines/router.py), as plain Python: no processes, no clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidal.engines.router import NoReplica, Router, prefix_hashes
from tidal.wire import EngineStats

BLOCK = 4


def make_router(num_replicas=2, max_num_seqs=8, num_blocks=100, slack=2, stats=None) -> Router:
    router = Router(num_replicas, BLOCK, affinity_slack=slack)
    for i in range(num_replicas):
        reported = (stats or {}).get(i, EngineStats(num_total_blocks=num_blocks))
        router.replica_up(i, max_num_seqs, num_blocks, lambda reported=reported: reported)
    return router


def prompt(prefix: int, length: int = 16, suffix: int = 0) -> list[int]:
    return [prefix] * (length - 1) + [1000 + suffix]


def test_prefix_hashes_cover_full_blocks_and_chain():
    a = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    assert len(a) == 2  # the ninth token is a partial block
    b = prefix_hashes([0, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert a[1] != b[1]  # same second block, different first block: a different prefix


def test_concurrent_distinct_prompts_spread_evenly():
    router = make_router()
    picks = [router.route(prompt(p)).index for p in range(6)]
    assert picks == [0, 1, 0, 1, 0, 1]


def test_shared_prefixes_stay_on_the_replica_that_holds_them():
    router = make_router(slack=8)
    first_a = router.route(prompt(7, suffix=1))
    first_b = router.route(prompt(9, suffix=1))
    assert first_a.index != first_b.index and first_a.reason == first_b.reason == "load"
    for suffix in range(2, 5):
        a = router.route(prompt(7, suffix=suffix))
        b = router.route(prompt(9, suffix=suffix))
        assert (a.index, a.reason, a.num_cached_blocks) == (first_a.index, "prefix", 3)
        assert (b.index, b.reason) == (first_b.index, "prefix")


def test_affinity_yields_to_load_beyond_the_slack():
    router = make_router(slack=2)
    holder = router.route(prompt(7)).index
    picks = [router.route(prompt(7, suffix=s)) for s in range(1, 8)]
    # the holder takes the shared prefix while it is at most 2 requests busier than the other
    assert [p.index for p in picks[:2]] == [holder, holder]
    assert any(p.index != holder and p.reason == "load" for p in picks)
    loads = [router.replicas[i].num_assigned for i in range(2)]
    assert abs(loads[0] - loads[1]) <= 3


def test_a_replica_short_of_kv_blocks_is_avoided():
    full = EngineStats(num_total_blocks=100, num_used_blocks=99)
    router = make_router(stats={0: full, 1: EngineStats(num_total_blocks=100)})
    assert [router.route(prompt(p)).index for p in range(3)] == [1, 1, 1]


def test_release_and_replica_lifetime():
    router = make_router()
    serving = [True, True]  # the replicas' state table, which the router asks (never copies)
    for i in range(2):
        router.replicas[i].serving = lambda i=i: serving[i]
    decision = router.route(prompt(1))
    serving[decision.index] = False
    assert router.num_up == 1
    assert {router.route(prompt(p)).index for p in range(3)} == {1 - decision.index}
    serving[decision.index] = True
    router.replica_up(decision.index, 8, 100, EngineStats, lambda: serving[decision.index])
    router.release(decision.index, decision.generation)  # from its former life: not counted
    assert router.replicas[decision.index].num_assigned == 0
    assert router.route(prompt(2, suffix=1)).index == decision.index  # the empty one
    router.release(decision.index, decision.generation)  # still not counted, with a request to miscount
    assert router.replicas[decision.index].num_assigned == 1
    serving[0] = serving[1] = False
    with pytest.raises(NoReplica):
        router.route(prompt(1))


def test_remembered_prefixes_are_bounded_by_the_cache_size():
    router = make_router(num_replicas=1, num_blocks=10)
    for p in range(20):
        router.route(prompt(p, length=12))
    assert len(router.replicas[0].prefixes) == 10


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(4, 40), st.booleans()), max_size=60))
def test_counts_stay_exact_and_affinity_stays_within_the_slack(events):
    router = make_router(num_replicas=3, slack=2)
    open_decisions = []
    for prefix, length, end_one in events:
        before = [v.num_assigned for v in router.replicas]
        decision = router.route(prompt(prefix, length))
        open_decisions.append(decision)
        # affinity never picks a replica more than the slack busier than the least loaded one
        assert before[decision.index] <= min(before) + router.affinity_slack
        if decision.reason == "load":
            assert before[decision.index] == min(before)
        if end_one:
            d = open_decisions.pop(0)
            router.release(d.index, d.generation)
        counts = [sum(d.index == i for d in open_decisions) for i in range(3)]
        assert [v.num_assigned for v in router.replicas] == counts
