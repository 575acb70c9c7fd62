"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a sequence's tail.

The sequence's tokens are kept as int32 bytes, so the search is ``bytes.rfind`` (C speed, no Python
loop over the tokens): a hit at an offset that is not a multiple of 4 straddles two tokens and the
search goes on before it. Appending a token costs 4 bytes; the text is built once, at the
sequence's first lookup.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.gpu.sequence import Sequence


class NgramIndex:
    """One sequence's tokens, searchable for its own n-grams."""

    __slots__ = ("_bytes", "num_tokens")

    def __init__(self) -> None:
        self._bytes = bytearray()
        self.num_tokens = 0

    def sync(self, token_ids: list[int]) -> None:
        """Take the tokens appended since the last call (the list only grows while the sequence lives)."""
        if len(token_ids) > self.num_tokens:
            self._bytes += array("i", token_ids[self.num_tokens:]).tobytes()
            self.num_tokens = len(token_ids)

    def propose(self, token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
        """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of the last n tokens,
        for the largest n in [min_n, max_n] that has one; [] when none does."""
        self.sync(token_ids)
        haystack = self._bytes
        length = self.num_tokens
        for n in range(min(max_n, length - 1), min_n - 1, -1):
            needle = bytes(haystack[4 * (length - n):])
            end = 4 * (length - 1)  # an occurrence must end before the last token: one token follows it
            while True:
                at = haystack.rfind(needle, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return token_ids[start:start + num_tokens]
                end = at + len(needle) - 1  # straddles two tokens: look before it
        return []


class NgramProposer:
    """The ``ngram`` method's proposal source (``speculator.ProposalSource``): one sequence at a time, each
    searching its own tokens (an ``NgramIndex`` kept in its speculation state)."""

    batched = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        proposals = []
        for seq, num_tokens in wants:
            state = seq.speculation
            if state.source is None:
                state.source = NgramIndex()
            proposals.append(state.source.propose(seq.token_ids, num_tokens, self.min_n, self.max_n))
        return proposals
