"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of a sequence's tail.

The sequence's tokens are kept as int32 bytes, so the search is ``bytes.rfind`` (C speed, no Python
loop over the tokens): a hit at an offset that is not a multiple of 4 straddles two tokens and the
search goes on before it. Appending a token costs 4 bytes; the text is built once, at the
sequence's first lookup.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
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


POOL_ENTRIES = 1 << 18  # n-grams the shared pool keeps, least recently seen dropped first (~40 MB at most)
POOL_LEARN = 1024  # a sequence's first proposal teaches the pool its last this many tokens (a bounded step cost)


class SharedNgrams:
    """n-grams of every proposing sequence, shared across requests (llama.cpp's ngram-mod): which token
    followed each n-gram most recently. A request whose own tokens hold no match takes its proposal from
    what earlier or concurrent requests wrote (a repeated answer, a common boilerplate). Bounded: at most
    ``max_entries`` n-grams, the least recently seen dropped first."""

    def __init__(self, min_n: int, max_n: int, max_entries: int = POOL_ENTRIES) -> None:
        self.min_n, self.max_n, self.max_entries = min_n, max_n, max_entries
        self._next: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def add(self, token_ids: list[int], start: int) -> None:
        """Learn the n-grams that end before each token from ``start`` on (each with the token after it)."""
        table = self._next
        for end in range(max(start, self.min_n), len(token_ids)):
            follower = token_ids[end]
            for n in range(self.min_n, min(self.max_n, end) + 1):
                key = tuple(token_ids[end - n:end])
                table[key] = follower
                table.move_to_end(key)
        while len(table) > self.max_entries:
            table.popitem(last=False)

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens, each the follower of the longest n-gram the pool knows ending the
        sequence (its proposal so far included); [] when the pool knows none."""
        context = token_ids[-self.max_n:]
        proposal: list[int] = []
        while len(proposal) < num_tokens:
            for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
                follower = self._next.get(tuple(context[-n:]))
                if follower is not None:
                    break
            else:
                break
            proposal.append(follower)
            context = (context + [follower])[-self.max_n:]
        return proposal


class NgramProposer:
    """The ``ngram`` method's proposal source (``speculator.ProposalSource``): one sequence at a time, each
    searching its own tokens first (an ``NgramIndex`` kept in its speculation state), then the pool of
    n-grams every proposing sequence has written (``SharedNgrams``)."""

    batched = False

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.pool = SharedNgrams(min_n, max_n)

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        proposals = []
        for seq, num_tokens in wants:
            state = seq.speculation
            if state.source is None:
                state.source = NgramIndex()
            index = state.source
            pooled = index.num_tokens  # what of this sequence the pool has learnt (its index's length)
            proposal = index.propose(seq.token_ids, num_tokens, self.min_n, self.max_n)
            self.pool.add(seq.token_ids, max(pooled, len(seq.token_ids) - POOL_LEARN))
            if not proposal:
                proposal = self.pool.propose(seq.token_ids, num_tokens)
            proposals.append(proposal)
        return proposals
