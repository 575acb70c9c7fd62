"""Scheduler properties, without a model: under random arrivals, aborts and tight KV caches,
every step respects the token budget and max_num_seqs, decodes come before prefill chunks,
nothing is dropped (every request completes), and all blocks are free at the end."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.block_manager import BlockManager
from tidal.gpu.scheduler import Scheduler
from tidal.gpu.sequence import Sequence, SequenceStatus
from tidal.wire import SamplingParams


def make_seq(rid: int, prompt_len: int, max_tokens: int, priority: int = 0) -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=[(rid * 31 + i) % 97 for i in range(prompt_len)],
                    params=SamplingParams(max_tokens=max_tokens), priority=priority, arrival_time=float(rid),
                    detokenizer=None)  # type: ignore[arg-type]


def run_step(scheduler: Scheduler, budget: int, max_seqs: int) -> list[Sequence]:
    """One step as the engine does it (the model samples token 7); returns the sequences that finished."""
    batch = scheduler.schedule()
    assert batch.num_tokens <= budget
    assert len(scheduler.running) <= max_seqs
    kinds = [seq.num_computed_tokens + n == seq.num_tokens and n == 1 for seq, n in batch.entries]
    assert kinds == sorted(kinds, reverse=True), "decodes first, then prefill chunks"
    for seq, n in batch.entries:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * scheduler.block_manager.block_size >= seq.num_computed_tokens + n
    assert batch.sampling == [seq for seq, n in batch.entries if seq.num_computed_tokens + n == seq.num_tokens], \
        "exactly the entries that reach their last token sample, in entry order"
    appended = scheduler.commit(batch, [7] * len(batch.sampling))
    scheduler.block_manager.check_invariants()
    finished = [seq for seq in appended if seq.is_finished]
    assert all(seq.finish_reason == "length" and len(seq.output_token_ids) == seq.params.max_tokens
               for seq in finished)
    return finished


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(0, 6)),
                      min_size=1, max_size=14),
    num_blocks=st.integers(6, 30),
    budget=st.integers(4, 64),
    max_seqs=st.integers(1, 6),
    by_priority=st.booleans(),
    aborts=st.sets(st.integers(0, 13), max_size=4),
)
def test_every_request_completes_within_the_bounds(requests, num_blocks, budget, max_seqs, by_priority, aborts):
    block_size = 4
    blocks = BlockManager(num_blocks, block_size)
    scheduler = Scheduler(blocks, max_num_seqs=max_seqs, max_num_batched_tokens=budget, by_priority=by_priority)
    capacity = num_blocks * block_size
    seqs = []
    for rid, (prompt_len, max_tokens, priority, arrive_at) in enumerate(requests):
        # as the engine guarantees: prompt + output fit in the whole cache
        prompt_len = min(prompt_len, capacity - max_tokens)
        seqs.append((arrive_at, make_seq(rid, max(1, prompt_len), max_tokens, priority)))
    done: set[int] = set()
    aborted: set[int] = set()
    for step in range(3000):
        for arrive_at, seq in seqs:
            if arrive_at == step:
                scheduler.add(seq)
        if step == 3:  # aborts land mid-run, in any state
            for arrive_at, seq in seqs:
                if seq.request_id in aborts and arrive_at <= step and not seq.is_finished:
                    scheduler.remove(seq)
                    aborted.add(seq.request_id)
        done.update(seq.request_id for seq in run_step(scheduler, budget, max_seqs))
        if step > max(a for a, _ in seqs) and not scheduler.has_work():
            break
    assert done | aborted == {seq.request_id for _, seq in seqs}, "no request is dropped or stuck"
    assert blocks.num_used_blocks == 0 and blocks.num_free_blocks == num_blocks


def test_priority_order_and_preemption_of_the_least_urgent():
    blocks = BlockManager(4, 4)  # 16 tokens in all
    scheduler = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=64, by_priority=True)
    low = make_seq(1, 7, 20, priority=5)
    high = make_seq(2, 7, 20, priority=0)
    scheduler.add(low)
    run_step(scheduler, 64, 4)
    scheduler.add(high)
    batch = scheduler.schedule()
    # both fit at first; as they grow, the cache runs out and the less urgent one yields
    steps = 0
    while low not in batch.preempted and steps < 20:
        scheduler.commit(batch, [7] * len(batch.sampling))
        batch = scheduler.schedule()
        steps += 1
    assert low in batch.preempted and low.status is SequenceStatus.WAITING and not low.block_table
    assert high.status is SequenceStatus.RUNNING


def test_a_tie_of_the_same_instant_goes_to_the_lower_request_id():
    # The frontend hands ids out in admission order (ActiveRequest.urgency ties by id): the engine
    # agrees with it even when it learns of the later request first (a grammar that compiled sooner).
    scheduler = Scheduler(BlockManager(2, 4), max_num_seqs=1, max_num_batched_tokens=64, by_priority=True)
    later, earlier = make_seq(2, 4, 1), make_seq(1, 4, 1)
    later.arrival_time = earlier.arrival_time = 0.5
    scheduler.add(later)
    scheduler.add(earlier)
    assert [seq for seq, _ in scheduler.schedule().entries] == [earlier]
    assert scheduler.waiting == [later]
