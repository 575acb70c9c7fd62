"""StopMatcher against a naive reference, and the cost of stop strings at the request bounds.

Small alphabets make stop strings overlap themselves and each other (the cases a matcher
gets wrong); the cost tests use the documented bounds of tidal.openai.requests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.detokenizer import IncrementalDetokenizer
from tidal.gpu.stop_strings import StopMatcher
from tidal.openai.requests import MAX_STOP_CHARS, MAX_STOP_STRINGS

stop_sets = st.lists(st.text("ab", min_size=1, max_size=6), min_size=1, max_size=4).map(tuple)
chunks = st.lists(st.text("abc", max_size=5), max_size=20)


def naive_hold(text: str, stops: tuple[str, ...]) -> int:
    """Longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=500, deadline=None)
@given(stops=stop_sets, pieces=chunks)
def test_matcher_holds_the_longest_stop_prefix_suffix_and_sees_every_completion(stops, pieces):
    matcher = StopMatcher(stops)
    text = ""
    for piece in pieces:
        before = text
        completed = matcher.feed(piece)
        text += piece
        # reference: the first end position at which some stop string occurs
        first_end = next((i for i in range(len(before) + 1, len(text) + 1)
                          if any(text[:i].endswith(s) for s in stops)), None)
        assert completed == (first_end is not None)
        if completed:
            assert any(text[:first_end].endswith(s) for s in stops)
            return
        assert matcher.held_length == naive_hold(text, stops)


class CharTokenizer:
    """One token per character: decode is the identity on ``chr`` (enough for stop strings)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


@settings(max_examples=300, deadline=None)
@given(stops=stop_sets, output=st.text("abc", max_size=40))
def test_detokenizer_releases_all_but_the_held_suffix_and_cuts_at_the_earliest_stop(stops, output):
    detokenizer = IncrementalDetokenizer(CharTokenizer(), [], stops, True)  # type: ignore[arg-type]
    released = ""
    for i, ch in enumerate(output):
        released += detokenizer.append(ord(ch))
        seen = output[: i + 1]
        if detokenizer.stop_string is not None:
            cut = min(seen.find(s) for s in stops if s in seen)
            assert released == seen[:cut] and seen.find(detokenizer.stop_string) == cut
            return
        assert not any(s in seen for s in stops)
        assert released == seen[: len(seen) - naive_hold(seen, stops)]
    assert released + detokenizer.flush() == output


def test_a_long_partial_match_that_fails_falls_back_to_nothing():
    # "aaa...ab" after many a's: a "c" must fall back through every state; the result is empty
    stops = tuple("a" * (MAX_STOP_CHARS - 1 - i) + "b" for i in range(MAX_STOP_STRINGS))
    matcher = StopMatcher(stops)
    assert not matcher.feed("a" * (2 * MAX_STOP_CHARS))
    assert matcher.held_length == MAX_STOP_CHARS - 1
    assert not matcher.feed("c")
    assert matcher.held_length == 0
    assert matcher.feed("a" * (MAX_STOP_CHARS - 2) + "b")  # and it still finds the shortest stop


def test_stop_strings_at_the_bounds_hold_the_longest_partial_match_and_stop_on_completion():
    """16 stop strings of the maximum length, all alike (the worst case for the old prefix set,
    which took seconds to build here): the output keeps matching long prefixes, so the longest
    is held back until the one character that completes a stop string arrives."""
    stops = tuple("x" * (MAX_STOP_CHARS - 1 - i) + "y" for i in range(MAX_STOP_STRINGS))
    detokenizer = IncrementalDetokenizer(CharTokenizer(), [], stops, True)  # type: ignore[arg-type]
    released = "".join(detokenizer.append(ord("x")) for _ in range(3 * MAX_STOP_CHARS))
    assert detokenizer.stop_string is None
    assert released == "x" * (3 * MAX_STOP_CHARS - (MAX_STOP_CHARS - 1))
    assert detokenizer.append(ord("y")) == ""  # the held x's belong to the longest stop string
    assert detokenizer.stop_string == stops[0]
