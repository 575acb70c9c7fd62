"""Prompt lookup's search (``NgramIndex``) against a plain reference: the tokens after the latest earlier
occurrence of the longest matching tail."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.speculative.ngram import NgramIndex


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
