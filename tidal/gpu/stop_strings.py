"""Stop-string matching over a stream of text, linear in the text, O(1) to set up.

One request's stop strings, each with a Knuth-Morris-Pratt state: the length of the longest
suffix of the text so far that is a prefix of that stop string. The largest of these is the
text the detokenizer must hold back, because what follows may still complete a stop string.

Costs, whatever the length of the stop strings:
* setup: nothing is precomputed. A stop string's failure table (KMP's prefix function) is
  extended only as far as the text has actually matched it, so a request whose stop strings
  never match pays nothing for their length;
* reading text: amortised O(1) per character and stop string, and at most a few fallbacks
  for any one character (Knuth's refinement of the failure table); a stop string that is
  not partly matched skips ahead to the next occurrence of its first character with one
  ``str.find`` (C speed), which is the common case.

(The earlier design built the set of every prefix of every stop string: quadratic in a stop
string's length, which let one request stall the engine for seconds.)
"""

from __future__ import annotations


class StopMatcher:
    """Tracks which stop strings the text read so far partly matches."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        if not all(stops):
            raise ValueError("stop strings must not be empty")
        self.stops = stops
        self._matched = [0] * len(stops)  # KMP state per stop string
        # Tables per stop string, computed up to the longest match reached.
        # fail[i]: length of the longest proper prefix of stop[:i + 1] that is also its suffix.
        # skip[k]: where a mismatch in state k goes, passing over states that expect the same
        # character as k (they would mismatch too): Knuth's refinement, which keeps even one
        # character's fallback short (a few states instead of up to the stop string's length).
        self._fail: list[list[int]] = [[0] for _ in stops]
        self._skip: list[list[int]] = [[0, 0] for _ in stops]

    @property
    def held_length(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        return max(self._matched, default=0)

    def feed(self, text: str) -> bool:
        """Read more text. True if a stop string now occurs in the text read (the caller then
        stops reading: the states are meaningless after a completion)."""
        return any(self._advance(i, text) for i in range(len(self.stops)))

    def _advance(self, index: int, text: str) -> bool:
        stop, fail, skip = self.stops[index], self._fail[index], self._skip[index]
        matched = self._matched[index]
        pos, end = 0, len(text)
        while pos < end:
            if matched == 0:
                pos = text.find(stop[0], pos)
                if pos == -1:
                    break
                matched = 1
            else:
                ch = text[pos]
                while matched and stop[matched] != ch:
                    matched = skip[matched]
                if stop[matched] == ch:
                    matched += 1
            pos += 1
            if matched == len(stop):
                self._matched[index] = matched
                return True
            if matched > len(fail):
                self._extend(stop, fail, skip)
        self._matched[index] = matched
        return False

    @staticmethod
    def _extend(stop: str, fail: list[int], skip: list[int]) -> None:
        """Add the next entry of ``stop``'s tables (amortised O(1): KMP's prefix function)."""
        i = len(fail)
        k = fail[i - 1]
        while k and stop[i] != stop[k]:
            k = fail[k - 1]
        fail.append(k + 1 if stop[i] == stop[k] else 0)
        state, fallback = i + 1, fail[i]  # state < len(stop): a completed match returns first
        skip.append(skip[fallback] if fallback and stop[fallback] == stop[state] else fallback)
