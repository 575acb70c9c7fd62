"""How many tokens each sequence proposes this step, and the books of what was accepted.

Verification costs rows in the pass. The CPU linear kernels (bf16, int8/int4) multiply four rows per
read of a weight block (``ROW_TILE``); a fifth row is a second pass over the weights, from L2, and on
this project's hosts a 5-row step took about twice a 1-row one (SmolLM2-135M bf16), while 2-4 rows
cost what one does. So each step:

* the batch's proposed tokens only fill the rows its decodes leave free in their last tile of
  ``ROW_TILE`` (3 at one decode, 0 at 4, 8 or 16), within ``MAX_VERIFY_ROWS`` rows in all and the step's
  token budget: a batch with no free row proposes nothing (K = 0) and runs exactly as without
  speculation, so speculation never makes a step dearer than the one it replaces;
* each sequence proposes at most as many tokens as its own recent acceptance pays for: with a
  per-token acceptance estimate ``a``, the j-th proposed token is worth ``a**j`` expected tokens and
  is proposed only while that is at least ``MIN_GAIN``. A sequence whose proposals keep failing
  proposes nothing; its estimate drifts back to the prior while it rests, so it tries again later;
* never past the request's max_tokens or the model's length (each step still yields one token more
  than it accepts).

Which tokens are proposed is the ``ProposalSource``'s: prompt lookup (``ngram.NgramProposer``) or a
draft model (``draft.DraftProposer``). Pure Python over ``Sequence`` (a draft model runs in its source).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tidal.gpu.speculative.ngram import NgramProposer
from tidal.wire import SpeculativeConfig

if TYPE_CHECKING:
    from tidal.gpu.sequence import Sequence

MAX_VERIFY_ROWS = 16  # rows of one pass (decodes + proposed tokens) beyond which nothing is proposed
ROW_TILE = 4  # rows the CPU linear kernels multiply per read of the weights (csrc/linear_bf16.cpp kMaxRows)
MIN_GAIN = 0.2  # expected accepted tokens a proposed token must be worth
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0  # the prior counts as this many verified tokens
DECAY = 0.8  # weight of the past in the acceptance estimate, per verification
REST_DECAY = 0.95  # per step without a proposal: the estimate's way back to the prior


class ProposalSource(Protocol):
    """Where proposed tokens come from (``ngram.NgramProposer``, ``draft.DraftProposer``; a CUDA EAGLE head
    would be a third). The speculator decides how many tokens each sequence may propose; the source says which."""

    # True: asked once per step for every sequence (a model's passes batch them); False: asked one sequence at
    # a time, so the rows one leaves unused go to the next
    batched: bool

    def propose(self, wants: list[tuple[Sequence, int]]) -> list[list[int]]:
        """For each (sequence, n >= 1): up to n tokens to follow its last one ([]: none)."""
        ...


# allocate the KV slots of a sequence's last token and n proposed tokens; how many of the n got them
Reserve = Callable[["Sequence", int], int]


class SequenceSpeculation:
    """One sequence's acceptance estimate (decayed counts of verified tokens) and its proposal source's
    state (``source``: an n-gram index, or the draft model's bookkeeping)."""

    __slots__ = ("source", "accepted", "verified")

    def __init__(self) -> None:
        self.source: Any = None
        self.accepted = 0.0
        self.verified = 0.0

    @property
    def acceptance(self) -> float:
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (self.verified + PRIOR_WEIGHT)

    def limit(self, k: int) -> int:
        """How many proposed tokens the acceptance estimate pays for, at most ``k``."""
        a = self.acceptance
        if a >= 1.0:
            return k
        if a <= MIN_GAIN:
            return 0
        return min(k, int(math.log(MIN_GAIN) / math.log(a)))

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        trials = min(num_accepted + 1, num_proposed)  # the tokens checked: up to the first rejection
        self.accepted = DECAY * self.accepted + num_accepted
        self.verified = DECAY * self.verified + trials

    def rest(self) -> None:
        self.accepted *= REST_DECAY
        self.verified *= REST_DECAY


class Speculator:
    """The engine's speculative decoding: proposals per step, and the counts /metrics shows."""

    def __init__(self, config: SpeculativeConfig, grammars: Any = None, source: ProposalSource | None = None) -> None:
        self.k = config.num_speculative_tokens
        self.source = source or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.grammars = grammars  # Grammars: a constrained proposal ends at its first forbidden token
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    @staticmethod
    def spare_rows(num_decodes: int, budget: int) -> int:
        """Rows this step's pass can carry proposals in at no extra cost (0: the step runs as without)."""
        return min(budget, MAX_VERIFY_ROWS - num_decodes, -num_decodes % ROW_TILE)

    def plan(self, decodes: list[Sequence], budget: int,
             reserve: Reserve | None = None) -> list[tuple[Sequence, list[int]]]:
        """Proposals for some of this step's decodes (most urgent first), within ``budget`` tokens.
        ``reserve`` (the scheduler's) allocates each proposal's KV slots, before a draft model writes them."""
        reserve = reserve or (lambda seq, n: n)
        spare = self.spare_rows(len(decodes), budget)
        planned = []
        if not self.source.batched:
            for seq in decodes:
                if spare <= 0:
                    break
                limit = self._limit(seq, spare)
                draft = self._check(seq, self.source.propose([(seq, limit)])[0]) if limit > 0 else []
                draft = draft[:reserve(seq, len(draft))] if draft else draft
                if draft:
                    planned.append((seq, draft))
                    spare -= len(draft)
        else:  # every sequence's share first, then one batched proposal
            wants = []
            for seq in decodes:
                if spare <= 0:
                    break
                limit = self._limit(seq, spare)
                limit = reserve(seq, limit) if limit > 0 else 0
                if limit > 0:
                    wants.append((seq, limit))
                    spare -= limit
            if wants:
                planned = [(seq, self._check(seq, draft))
                           for (seq, _), draft in zip(wants, self.source.propose(wants)) if draft]
        return [(seq, draft) for seq, draft in planned if draft]

    def _limit(self, seq: Sequence, spare: int) -> int:
        """How many tokens ``seq`` may propose now (0: it rests)."""
        state = seq.speculation
        if state is None:
            state = seq.speculation = SequenceSpeculation()
        assert isinstance(state, SequenceSpeculation)
        # the step yields one token past what it accepts: stay within max_tokens and the model's length
        limit = min(state.limit(self.k), spare, seq.max_num_tokens - seq.num_tokens - 1)
        if limit <= 0:
            state.rest()
        return max(limit, 0)

    def _check(self, seq: Sequence, draft: list[int]) -> list[int]:
        """A constrained proposal ends at its first token the grammar forbids."""
        if self.grammars is not None and seq.params.structured is not None:
            return self.grammars.check_draft(seq, draft)
        return draft

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Book one verification of ``seq``'s proposal (the scheduler's commit)."""
        state = seq.speculation
        assert isinstance(state, SequenceSpeculation)
        state.observe(num_proposed, num_accepted)
        seq.num_draft_tokens += num_proposed
        seq.num_accepted_tokens += num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        for position in range(num_accepted):
            per_pos[position] += 1
