"""Prompt lookup's search (``NgramIndex``) against a plain reference: the tokens after the latest earlier
occurrence of the longest matching tail; and the pool shared across requests (``SharedNgrams``): what followed
each n-gram most recently, within its bound."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.speculative.ngram import NgramIndex, NgramProposer, SharedNgrams
from tidal.gpu.speculative.speculator import SequenceSpeculation


def sequence(tokens: list[int]):
    return SimpleNamespace(token_ids=list(tokens), speculation=SequenceSpeculation())


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest first; one token must follow
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3),
       st.integers(0, 20))
def test_proposals_match_the_reference(tokens, k, min_n, extra, grow):
    index = NgramIndex()
    index.propose(tokens[:max(1, len(tokens) - grow)], k, min_n, min_n + extra)  # built, then grown
    assert index.propose(tokens, k, min_n, min_n + extra) == reference(tokens, k, min_n, min_n + extra)


def test_a_match_straddling_two_tokens_is_not_a_match():
    # as int32 bytes, 256 = 00 01 00 00 and 1 = 01 00 00 00: the bytes of [1, 0] occur inside [256, 1] shifted
    tokens = [256, 1, 7, 0, 1, 0]
    assert NgramIndex().propose(tokens, 3, 2, 2) == reference(tokens, 3, 2, 2) == []
    assert NgramIndex().propose([5, 1, 0, 9, 1, 0], 2, 2, 2) == [9, 1]


def test_no_repeat_proposes_nothing():
    assert NgramIndex().propose(list(range(50)), 4, 1, 5) == []


def pool_reference(history: list[list[int]], tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What followed each n-gram most recently across ``history`` (in order), chained from ``tokens``'s tail."""
    follows: dict[tuple[int, ...], int] = {}
    for seq in history:
        for end in range(min_n, len(seq)):
            for n in range(min_n, min(max_n, end) + 1):
                follows[tuple(seq[end - n:end])] = seq[end]
    context, out = list(tokens), []
    while len(out) < k:
        for n in range(min(max_n, len(context)), min_n - 1, -1):
            if tuple(context[-n:]) in follows:
                out.append(follows[tuple(context[-n:])])
                context.append(out[-1])
                break
        else:
            break
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), max_size=30), min_size=1, max_size=4),
       st.lists(st.integers(0, 4), min_size=1, max_size=10), st.integers(1, 5), st.integers(1, 3), st.integers(0, 2))
def test_the_shared_pool_proposes_what_followed_most_recently_across_requests(history, tokens, k, min_n, extra):
    pool = SharedNgrams(min_n, min_n + extra)
    for seq in history:
        pool.add(seq, 0)
    assert pool.propose(tokens, k) == pool_reference(history, tokens, k, min_n, min_n + extra)


def test_a_request_with_no_match_of_its_own_takes_an_earlier_requests_continuation():
    proposer = NgramProposer(2, 3)
    earlier = sequence([1, 2, 3, 4, 5, 6, 7])
    assert proposer.propose([(earlier, 3)]) == [[]]  # nothing repeats inside it, and the pool was empty
    later = sequence([9, 8, 2, 3])  # its own tokens hold no repeat; "2 3" was followed by 4 5 6 before
    assert proposer.propose([(later, 3)]) == [[4, 5, 6]]


def test_the_pool_holds_at_most_its_bound_dropping_the_least_recently_seen():
    pool = SharedNgrams(2, 2, max_entries=4)
    pool.add([1, 2, 3, 4, 5], 0)  # (1,2) (2,3) (3,4): 3 n-grams
    pool.add([7, 8, 9], 0)  # (7,8): 4
    assert len(pool) == 4
    pool.add([2, 3, 6], 0)  # (2,3) seen again, now -> 6: still 4
    assert len(pool) == 4 and pool.propose([2, 3], 1) == [6]
    pool.add([10, 11, 12], 0)  # (10,11): a fifth; (1,2), the least recently seen, goes
    assert len(pool) == 4
    assert pool.propose([1, 2], 1) == [] and pool.propose([10, 11], 1) == [12] and pool.propose([3, 4], 1) == [5]
