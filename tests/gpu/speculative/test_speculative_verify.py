"""Verification's rejection sampling, on a five-token vocabulary: the tokens it emits are distributed as
tokens drawn one by one from the target's filtered distribution, whatever was proposed.

Rules for determinism: every draw comes from a generator seeded here (the global one or each row's own);
the chi-square bound is the 1e-6 tail of its distribution, so a correct sampler fails about once in a
million runs and a wrong rule (accepting with min(1, p/q) for a q that is not one-hot, a residual that
keeps the proposed token, filters applied after the removal) fails every time at these counts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tidal.gpu.sampler import filtered_probs
from tidal.gpu.speculative.verify import verify
from tidal.wire import SamplingParams

V = 5
TRIALS = 6000
# chi-square critical values at p = 1e-6 by degrees of freedom
CRITICAL = {1: 23.9, 2: 27.6, 3: 30.7, 4: 33.4}
LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.2],  # the row verifying the first proposed token
                       [0.1, 1.5, -0.5, 0.7, 1.0],  # the row after it (verifies the second / draws the bonus)
                       [1.0, 1.0, 1.0, 1.0, 1.0]])


def seqs(params: SamplingParams, draft: list[int], count: int, seeded: bool):
    return [SimpleNamespace(request_id=i, params=params, draft_token_ids=list(draft),
                            generator=torch.Generator().manual_seed(1000 + i) if seeded else None)
            for i in range(count)]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


def target(params: SamplingParams, row: int) -> torch.Tensor:
    p = filtered_probs(LOGITS[row:row + 1].clone(), [params])[0]
    return p / p.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=8, temperature=1.0),
    SamplingParams(max_tokens=8, temperature=0.7, top_k=3),
    SamplingParams(max_tokens=8, temperature=1.3, top_p=0.8),
    SamplingParams(max_tokens=8, temperature=1.0, min_p=0.2),
], ids=["plain", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("proposed", [0, 1, 3], ids=["likely", "middling", "filtered_or_unlikely"])
@pytest.mark.parametrize("seeded", [False, True], ids=["global", "seeded"])
def test_emitted_tokens_follow_the_target_distribution(params, proposed, seeded):
    torch.manual_seed(7)
    batch = seqs(params, [proposed, 2], TRIALS, seeded)
    logits = LOGITS.repeat(TRIALS, 1)  # three rows per sequence: proposal [proposed, 2] plus the bonus row
    verdict = verify(logits, batch, {})
    runs = [batch[i].draft_token_ids[:a] + [verdict.final[i]] for i, a in enumerate(verdict.accepted)]
    first = torch.bincount(torch.tensor([run[0] for run in runs]), minlength=V).double()
    stat, df = chi_square(first, target(params, 0))
    assert stat < CRITICAL[df], (first, target(params, 0))
    # given the first token was the proposed one, the second follows the next row's distribution
    second = torch.bincount(torch.tensor([run[1] for run in runs if run[0] == proposed], dtype=torch.int64),
                            minlength=V).double()
    if second.sum() > 200:
        stat, df = chi_square(second, target(params, 1))
        assert stat < CRITICAL[df], (second, target(params, 1))


def test_a_seeded_sequence_verifies_the_same_way_twice():
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    first = verify(LOGITS.repeat(50, 1), seqs(params, [1, 2], 50, True), {})
    second = verify(LOGITS.repeat(50, 1), seqs(params, [1, 2], 50, True), {})
    assert (first.accepted, first.final) == (second.accepted, second.final)


def test_greedy_accepts_exactly_the_argmax_run():
    params = SamplingParams(max_tokens=8, temperature=0.0)
    # argmaxes: row 0 -> 0, row 1 -> 1, row 2 -> 0 (the first of equal values)
    cases = {(0, 1): (2, 0), (0, 2): (1, 1), (3, 1): (0, 0)}
    for draft, (accepted, final) in cases.items():
        verdict = verify(LOGITS.clone(), seqs(params, list(draft), 1, False), {})
        assert (verdict.accepted[0], verdict.final[0]) == (accepted, final)
        assert verdict.row_tokens[:accepted + 1] == list(draft[:accepted]) + [final]


def test_a_row_the_grammar_cannot_leave_stops_the_run_before_it():
    params = SamplingParams(max_tokens=8, temperature=0.0)
    verdict = verify(LOGITS.clone(), seqs(params, [0, 1], 1, False), {0: 1})
    assert (verdict.accepted[0], verdict.final[0]) == (1, None)  # token 0 accepted; row 1 gives nothing
