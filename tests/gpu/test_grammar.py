"""The engine's structured-output path in-process (tidal.gpu.grammar): compile off the step
loop, batched masks, the end of a grammar, refusals and aborts while a grammar compiles.

tidal-tiny has random weights: at temperature 1 only the mask makes its output valid."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "kind": {"enum": ["a", "b", "c"]},
    "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    "note": {"type": "string", "maxLength": 8},
}, "required": ["id", "kind", "flags", "note"], "additionalProperties": False}
CONSTRAINT = StructuredOutput("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=512, max_num_seqs=64))


def run(engine: Engine, requests: dict[int, SamplingParams], prompt=(5, 6, 7, 8)):
    for rid, params in requests.items():
        engine.add_request(AddRequest(rid, list(prompt), params))
    texts = {rid: "" for rid in requests}
    outputs = {rid: [] for rid in requests}
    for _ in range(10_000):
        if not engine.has_work():
            break
        engine.step()
        report = engine.take_report()
        for out in report.outputs if report else []:
            texts[out.request_id] += out.text
            outputs[out.request_id].append(out)
    assert not engine.sequences and engine.grammars.num_waiting == 0
    assert engine.block_manager.num_used_blocks == 0
    return texts, outputs


def test_every_seed_gives_a_valid_document_in_one_batch(engine):
    texts, outputs = run(engine, {i: SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured=CONSTRAINT)
                                  for i in range(48)})
    for rid, text in texts.items():
        assert outputs[rid][-1].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts.values())) > 24


def test_unconstrained_rows_share_the_batch_untouched(engine):
    """A plain greedy request gives the same tokens next to constrained ones as alone."""
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone, _ = run(engine, {100: plain})
    mixed, _ = run(engine, {101: plain, **{200 + i: SamplingParams(max_tokens=60, temperature=1.0, seed=i,
                                                                  structured=CONSTRAINT) for i in range(8)}})
    assert mixed[101] == alone[100]


def test_a_complete_grammar_ends_the_request_even_under_ignore_eos(engine):
    choice = StructuredOutput("choice", json.dumps(["alpha", "beta"]))
    texts, outputs = run(engine, {300: SamplingParams(max_tokens=50, temperature=1.0, seed=1, ignore_eos=True,
                                                      structured=choice)})
    assert texts[300] in ("alpha", "beta") and outputs[300][-1].finish_reason == "stop"


def test_a_constraint_that_does_not_compile_is_refused_before_scheduling(engine):
    bad = StructuredOutput("json_schema", '{"type": "nonsense"}')
    _, outputs = run(engine, {400: SamplingParams(max_tokens=5, structured=bad)})
    [only] = outputs[400]
    assert only.finish_reason == "abort" and only.token_ids == [] and "nonsense" in only.error
    engine.block_manager.check_invariants()


def test_abort_while_the_grammar_compiles_frees_everything(engine):
    fresh = StructuredOutput("regex", "[a-z]{3,5}-[0-9]{1,3}-abort-test")  # not cached: it must compile
    engine.add_request(AddRequest(500, [5, 6, 7], SamplingParams(max_tokens=20, structured=fresh)))
    assert engine.grammars.num_waiting == 1 and engine.has_work()
    engine.abort([500])
    assert engine.grammars.num_waiting == 0 and not engine.sequences
    report = engine.take_report()
    assert report.finished == [500] and not report.outputs
    assert not engine.has_work()


def test_a_gated_constraint_applies_only_after_its_gate_ids(engine):
    """A reasoning model's constraint waits for ``</think>``: the tokens up to the gate are the
    model's own (a greedy request's), the grammar holds from the next token on."""
    _, free_outputs = run(engine, {500: SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)})
    free_ids = [t for out in free_outputs[500] for t in out.token_ids]
    gate = tuple(free_ids[2:4])
    cut = next(i for i in range(len(free_ids)) if tuple(free_ids[i:i + 2]) == gate) + 2
    choice = StructuredOutput("choice", json.dumps(["alpha", "beta"]), after=gate)
    texts, outputs = run(engine, {501: SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                      structured=choice)})
    ids = [t for out in outputs[501] for t in out.token_ids]
    assert ids[:cut] == free_ids[:cut]
    assert texts[501].endswith(("alpha", "beta")) and outputs[501][-1].finish_reason == "stop", texts[501]
    assert len(ids) < 40
