"""Aborts at random instants with speculation on: every block of an aborted request, its proposal's and
its rejected tail's included, is free by the end of the step its abort arrived in, and the books balance
after every step.

Rules for determinism: hypothesis picks the requests, the steps and the way each abort arrives (between
steps, or mid-step through the pipe reader's path ``abort_arrived``, applied in the abort window); the
engine is tidal-tiny with greedy requests whose prompts repeat, so most steps carry proposals. Both methods:
n-gram lookup, and a draft model (tidal-tiny at int4) whose KV cache lives in the same blocks, so freeing
the blocks frees it too."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.gpu.engine import Engine
from tidal.wire import AbortRequests, AddRequest, EngineConfig, SamplingParams, SpeculativeConfig

TEXT = "one two three four one two three four one two three four one two"
_ids = itertools.count(1)


@pytest.fixture(scope="module", params=[SpeculativeConfig("ngram", 6, 1, 3),
                                        SpeculativeConfig("draft_model", 6, model="tidal-tiny", quantization="int4")],
                ids=["ngram", "draft"])
def engine(request):
    return Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=64, block_size=4, max_num_seqs=8,
                               speculative=request.param))


def held_blocks(engine: Engine) -> int:
    return len({b for seq in engine.sequences.values() for b in seq.block_table})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 2), st.integers(1, 60)), min_size=1, max_size=6),
       )
def test_an_abort_at_any_instant_frees_every_block_within_one_step(engine, requests):
    base = engine.tokenizer.encode(TEXT).ids
    live: dict[int, tuple[int, int]] = {}  # request id -> (abort at step, how)
    for abort_at, how, max_tokens in requests:
        rid = next(_ids)
        engine.add_request(AddRequest(rid, base[:8 + rid % 7] + base, SamplingParams(max_tokens=max_tokens,
                                                                                   temperature=0.0)))
        live[rid] = (abort_at, how)
    for step in range(400):
        if not engine.has_work():
            break
        pending = []
        for rid, (abort_at, how) in list(live.items()):
            if step == abort_at and rid in engine.sequences:
                if how == 0:  # between steps, as the process loop applies one
                    engine.abort([rid])
                    assert rid not in engine.sequences
                else:  # arrives while the step runs: applied in its abort window or at the next launch
                    engine.abort_arrived(AbortRequests([rid]))
                    pending.append(rid)
        engine.step()
        engine.take_report()
        for rid in pending:
            assert rid not in engine.sequences, "an abort that arrived during a step is applied by its end"
        engine.block_manager.check_invariants()
        # every block in use belongs to a live request (none leaks from a proposal or a rejected tail)
        assert engine.block_manager.num_used_blocks == held_blocks(engine)
    assert not engine.has_work() and not engine.sequences
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_an_abort_while_a_proposal_is_verified_frees_its_blocks_in_that_step(engine):
    """The abort arrives while the pass in flight carries the request's proposal (its slots allocated)."""
    base = engine.tokenizer.encode(TEXT).ids
    rid = next(_ids)
    engine.add_request(AddRequest(rid, base + base, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)))
    for _ in range(200):
        engine.step()
        engine.take_report()
        in_flight = engine._in_flight
        if in_flight is not None and in_flight.batch.num_draft_tokens:
            break
    else:
        pytest.fail("no proposal was ever verified")
    seq = engine.sequences[rid]
    assert seq.draft_token_ids and len(seq.block_table) * 4 >= seq.num_tokens + len(seq.draft_token_ids)
    engine.abort_arrived(AbortRequests([rid]))
    engine.step()  # the verification pass ends, its abort window frees the request
    report = engine.take_report()
    assert rid not in engine.sequences and rid in report.finished
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
