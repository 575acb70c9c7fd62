"""Block manager properties: under any sequence of operations no block leaks or is freed
twice, and once every request is gone every block is free. Pure Python, no model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.block_manager import ROOT_HASH, BlockManager, hash_block
from tidal.gpu.sequence import Sequence
from tidal.wire import SamplingParams

BLOCK = 4


def make_seq(request_id: int, tokens: list[int]) -> Sequence:
    return Sequence(request_id=request_id, prompt_token_ids=list(tokens), params=SamplingParams(max_tokens=8),
                    priority=0, arrival_time=0.0, detokenizer=None)  # type: ignore[arg-type]


def compute(bm: BlockManager, seq: Sequence, n: int) -> bool:
    """Schedule ``n`` more tokens of ``seq`` (with its prefix on first schedule), as the scheduler does."""
    prefix = bm.lookup_prefix(seq) if not seq.block_table else []
    n = min(n, seq.num_tokens - (len(prefix) * BLOCK if prefix else seq.num_computed_tokens))
    if n <= 0 or not bm.can_allocate(seq, n, prefix):
        return False
    bm.allocate(seq, n, prefix)
    if prefix:  # the scheduler counts the prefix cache's tokens as computed and cached
        seq.num_computed_tokens = seq.num_cached_tokens = len(prefix) * BLOCK
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)
    return True


ops = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "decode", "finish", "preempt"]), st.integers(0, 7),
              st.integers(1, 12)),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 24), shared_prefix=st.booleans())
def test_no_leak_no_double_free(ops, num_blocks, shared_prefix):
    bm = BlockManager(num_blocks, BLOCK)
    live: dict[int, Sequence] = {}
    next_id = 0
    for op, slot, n in ops:
        if op == "add":
            # shared prompts exercise prefix hits and reference counts above one
            base = [1, 2, 3, 4, 5, 6, 7, 8] if shared_prefix else [100 + next_id] * 8
            seq = make_seq(next_id, base + [next_id] * n)
            next_id += 1
            if compute(bm, seq, n + 8):
                live[seq.request_id] = seq
            else:
                bm.free(seq)  # a request that could not start holds nothing
        elif live:
            seq = list(live.values())[slot % len(live)]
            if op == "grow":
                compute(bm, seq, n)
            elif op == "decode":
                if seq.num_computed_tokens == seq.num_tokens:
                    seq.append_token(seq.request_id)
                compute(bm, seq, 1)
            elif op == "finish":
                bm.free(live.pop(seq.request_id))
            elif op == "preempt":
                bm.free(seq)  # recompute later from scratch (maybe from the prefix cache)
                seq.num_computed_tokens = 0  # as the scheduler's preemption does
        bm.check_invariants()
        held = sum(len(s.block_table) for s in live.values())
        assert held >= bm.num_used_blocks  # shared blocks are counted once in used
        for s in live.values():
            assert len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)
    for seq in live.values():
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == num_blocks
    assert bm.num_used_blocks == 0


def test_prefix_cache_reuses_full_blocks_only():
    bm = BlockManager(16, BLOCK)
    a = make_seq(1, list(range(10)))  # 2 full blocks + 2 tokens
    assert compute(bm, a, 10)
    b = make_seq(2, list(range(9)) + [99])
    prefix = bm.lookup_prefix(b)
    assert prefix == a.block_table[:2]
    assert compute(bm, b, 10)
    assert b.num_cached_tokens == 8
    assert bm.ref_count(prefix[0]) == 2
    bm.free(a)
    assert bm.ref_count(prefix[0]) == 1
    bm.free(b)
    assert bm.num_used_blocks == 0
    # freed but still cached: a third request with the same start hits it
    c = make_seq(3, list(range(12)))
    assert bm.lookup_prefix(c) == prefix


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(16, BLOCK)
    a = make_seq(1, list(range(8)))
    assert compute(bm, a, 8)
    bm.free(a)
    again = make_seq(2, list(range(8)))
    # the last block is not taken from the cache: its last token must run to produce logits
    assert len(bm.lookup_prefix(again)) == 1


def test_cached_free_blocks_are_evicted_last_and_unhashed_first():
    bm = BlockManager(4, BLOCK)
    a = make_seq(1, list(range(8)))
    assert compute(bm, a, 8)
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    b = make_seq(2, [50] * 8)
    assert compute(bm, b, 8)  # takes the two never-hashed blocks
    assert bm.num_cached_blocks == 2 + 2
    c = make_seq(3, [60] * 4)
    assert compute(bm, c, 4)  # must evict one cached block now
    assert bm.num_cached_blocks == 4
    bm.check_invariants()


def test_allocate_without_room_raises():
    bm = BlockManager(2, BLOCK)
    seq = make_seq(1, list(range(12)))
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(MemoryError):
        bm.allocate(seq, 12)
    bm.check_invariants()


def test_double_free_is_detected():
    bm = BlockManager(4, BLOCK)
    seq = make_seq(1, list(range(4)))
    compute(bm, seq, 4)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="freed twice"):
        bm.free(seq)


# ------------------------------------------------------------------ prefix-cache keys


def test_block_keys_are_128_bit_digests_chained_from_the_parent():
    first = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert isinstance(first, bytes) and len(first) == 16
    assert hash_block(ROOT_HASH, [1, 2, 3, 4]) == first  # deterministic (no per-process hash seed)
    # the same tokens after a different parent are a different block
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(hash_block(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(first, [1, 2, 3, 4]) != first


def test_same_block_after_a_different_first_block_does_not_hit():
    bm = BlockManager(16, BLOCK)
    a = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert compute(bm, a, 9)
    b = make_seq(2, [0, 2, 3, 4, 5, 6, 7, 8, 9])  # second block equal, first differs
    assert bm.lookup_prefix(b) == []
    c = make_seq(3, [1, 2, 3, 4, 5, 6, 7, 0, 9])  # first block equal, second differs
    assert bm.lookup_prefix(c) == a.block_table[:1]


token_lists = st.lists(st.integers(0, 5), min_size=1, max_size=24)


@settings(max_examples=300, deadline=None)
@given(prompts=st.lists(token_lists, min_size=1, max_size=6), probe=token_lists)
def test_a_hit_is_exactly_the_longest_common_full_block_prefix(prompts, probe):
    """Against a reference that compares tokens: equal prefixes hit, different ones never do,
    and each hit block holds exactly the probe's tokens."""
    bm = BlockManager(64, BLOCK)
    contents: dict[int, list[int]] = {}  # block id -> tokens written into it
    for i, prompt in enumerate(prompts):
        seq = make_seq(i, prompt)
        assert compute(bm, seq, len(prompt))
        for j, block_id in enumerate(seq.block_table):
            contents[block_id] = prompt[j * BLOCK : (j + 1) * BLOCK]
        bm.free(seq)  # freed blocks stay cached (64 blocks: nothing is evicted)
    hit = bm.lookup_prefix(make_seq(99, probe))
    for j, block_id in enumerate(hit):
        assert contents[block_id] == probe[j * BLOCK : (j + 1) * BLOCK]
    # the reference: the longest run of full blocks some cached prompt shares with the probe
    max_blocks = (len(probe) - 1) // BLOCK
    expected = 0
    for prompt in prompts:
        shared = 0
        while (shared < max_blocks and (shared + 1) * BLOCK <= len(prompt)
               and prompt[: (shared + 1) * BLOCK] == probe[: (shared + 1) * BLOCK]):
            shared += 1
        expected = max(expected, shared)
    assert len(hit) == expected


def test_the_routers_prefix_hashes_are_the_engines_block_hashes():
    """The router's "same prefix" (tidal.engines.router) is the chain the prefix cache keys blocks by."""
    from tidal.engines.router import prefix_hashes

    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(1, list(range(100, 114)))  # three full blocks and two more tokens
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)
    assert len(seq.block_hashes) == 3
    assert prefix_hashes(seq.token_ids, 4) == seq.block_hashes
    assert prefix_hashes(seq.token_ids, 4, limit=2) == seq.block_hashes[:2]
