"""How many tokens a step proposes: only into the rows the batch's decodes leave free in their last tile of
four (the CPU kernels' rows per weight read), within each sequence's acceptance and length."""

from __future__ import annotations

from types import SimpleNamespace

from tidal.gpu.speculative.speculator import ROW_TILE, SequenceSpeculation, Speculator
from tidal.wire import SamplingParams, SpeculativeConfig

LOOP = [5, 6, 7, 8] * 6


def seq(max_num_tokens: int = 1000, tokens=LOOP):
    return SimpleNamespace(token_ids=list(tokens), num_tokens=len(tokens), max_num_tokens=max_num_tokens,
                           speculation=None, params=SamplingParams(max_tokens=8))


def planned(decodes, k: int = 8, budget: int = 2048) -> list[int]:
    plan = dict((id(s), d) for s, d in Speculator(SpeculativeConfig("ngram", k, 1, 4)).plan(decodes, budget))
    return [len(plan.get(id(s), [])) for s in decodes]


def test_proposals_fill_only_the_free_rows_of_the_last_tile():
    for count in range(1, 18):
        decodes = [seq() for _ in range(count)]
        for s in decodes:  # an estimate that pays for every token
            s.speculation = SequenceSpeculation()
            s.speculation.observe(8, 8)
            s.speculation.observe(8, 8)
        assert sum(planned(decodes)) == max(0, min(-count % ROW_TILE, 16 - count)), count


def test_the_prior_acceptance_proposes_two_tokens_and_a_failing_sequence_rests():
    fresh = seq()
    assert planned([fresh]) == [2]  # 0.5 ** 2 >= 0.2 > 0.5 ** 3
    failing = seq()
    failing.speculation = SequenceSpeculation()
    for _ in range(5):
        failing.speculation.observe(2, 0)
    assert planned([failing]) == [0]
    for _ in range(200):  # resting: the estimate drifts back to the prior and it tries again
        failing.speculation.rest()
    assert planned([failing]) == [2]


def test_no_proposal_past_max_tokens_or_the_budget():
    assert planned([seq(max_num_tokens=len(LOOP) + 2)]) == [1]  # the step still yields one token more
    assert planned([seq(max_num_tokens=len(LOOP) + 1)]) == [0]
    assert planned([seq()], budget=1) == [1]
    assert planned([seq(tokens=list(range(30)))]) == [0]  # nothing repeats: nothing to propose
