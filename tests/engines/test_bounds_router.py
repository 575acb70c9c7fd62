"""The router's two bounds at N and N+1 (tidal/engines/router.py), as plain Python:

* only the first ``MAX_AFFINITY_BLOCKS`` (256) full blocks of a prompt are hashed: prompts that first
  differ in block 256 (the last one hashed) have different prefixes, prompts that first differ in
  block 257 look the same to the router;
* with the default ``affinity_slack`` (32) the replica holding a prompt's prefix wins while it is
  busier than the least loaded one by 32 requests, and loses at 33.
"""

from __future__ import annotations

from tidal.engines.router import DEFAULT_AFFINITY_SLACK, MAX_AFFINITY_BLOCKS, Router, prefix_hashes
from tidal.wire import EngineStats

BLOCK = 4
NUM_BLOCKS = 10_000  # room for every prefix the tests send, so none is evicted


def differing_in_block(k: int) -> tuple[list[int], list[int]]:
    """Two prompts of MAX_AFFINITY_BLOCKS + 2 full blocks, equal except in their k-th block (1-based)."""
    length = (MAX_AFFINITY_BLOCKS + 2) * BLOCK
    a = [7] * length
    b = list(a)
    b[(k - 1) * BLOCK] = 8
    return a, b


def test_the_hashing_stops_after_256_blocks():
    assert MAX_AFFINITY_BLOCKS == 256
    a, b = differing_in_block(256)
    assert len(prefix_hashes(a, BLOCK)) == 256
    assert prefix_hashes(a, BLOCK)[:255] == prefix_hashes(b, BLOCK)[:255]
    assert prefix_hashes(a, BLOCK) != prefix_hashes(b, BLOCK)  # block 256 is hashed
    a, b = differing_in_block(257)
    assert prefix_hashes(a, BLOCK) == prefix_hashes(b, BLOCK)  # block 257 is not


def test_a_routed_prompt_counts_at_most_256_cached_blocks():
    router = Router(2, BLOCK)
    for i in range(2):
        router.replica_up(i, 8, NUM_BLOCKS, lambda: EngineStats(num_total_blocks=NUM_BLOCKS))
    a, b = differing_in_block(257)
    first = router.route(a)
    again = router.route(b)
    assert (again.index, again.reason, again.num_cached_blocks) == (first.index, "prefix", 256)
    a, b = differing_in_block(256)
    c = [9] + a[1:]  # a fresh first block: nothing shared with the prompts above
    router.route(c)
    d = list(c)
    d[255 * BLOCK] = 8
    assert router.route(d).num_cached_blocks == 255


def busy_holder(extra_load: int) -> str:
    """The reason the router gives for a prompt whose prefix replica 0 holds, with replica 0 carrying
    ``extra_load`` more requests than replica 1 (the router's own default slack)."""
    router = Router(2, BLOCK)
    for i in range(2):
        router.replica_up(i, 8, NUM_BLOCKS, lambda: EngineStats(num_total_blocks=NUM_BLOCKS))
    shared = [5] * (4 * BLOCK)
    assert router.route(shared).index == 0
    router.replicas[0].num_assigned = router.replicas[1].num_assigned + extra_load
    return router.route(shared + [6]).reason


def test_affinity_holds_up_to_the_default_slack_of_32_and_yields_at_33():
    assert DEFAULT_AFFINITY_SLACK == 32
    assert busy_holder(32) == "prefix"
    assert busy_holder(33) == "load"
