"""The engine's structured-output path in-process (tidal.gpu.grammar): compile off the step
loop, batched masks, the end of a grammar, refusals and aborts while a grammar compiles.

tidal-tiny has random weights: at temperature 1 only the mask makes its output valid."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tidal.gpu.engine import Engine
from tidal.gpu.grammar import cache_key
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
        if not engine.step():
            time.sleep(0.005)  # a grammar compiles on its thread: poll as the process loop does
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


# ---------------------------------------------------------------- bounds (issue 23 rows 7-11)

def test_a_repeated_schema_compiles_once_and_the_cache_is_bounded_in_bytes(engine):
    grammars = engine.grammars
    first = StructuredOutput("regex", "[a-f]{2,4}-cache-once")
    second = StructuredOutput("regex", "[g-m]{2,4}-cache-twice")
    before = grammars.num_compiles
    for rid in (600, 601):  # one after the other: the second is a cache hit
        run(engine, {rid: SamplingParams(max_tokens=30, temperature=1.0, seed=rid, structured=first)})
    assert grammars.num_compiles == before + 1
    size = grammars._cache[cache_key(first)].memory_size_bytes
    saved = grammars.cache_bytes
    grammars.cache_bytes = size * 3 // 2  # room for one grammar of this size, not two
    try:
        run(engine, {602: SamplingParams(max_tokens=30, temperature=1.0, seed=2, structured=second)})
        assert grammars.num_cached_bytes <= grammars.cache_bytes
        assert list(grammars._cache) == [cache_key(second)]  # the others went, oldest first
        run(engine, {603: SamplingParams(max_tokens=30, temperature=1.0, seed=3, structured=first)})
        assert grammars.num_compiles == before + 3  # evicted by bytes, so compiled again
        assert grammars.num_cached_bytes <= grammars.cache_bytes
    finally:
        grammars.cache_bytes = saved


def test_the_cache_keys_a_constraint_by_its_digest_not_its_text():
    huge = StructuredOutput("json_schema", '{"enum": [' + ",".join(['"v%d"' % i for i in range(100_000)]) + "]}")
    kind, digest = cache_key(huge)
    assert kind == "json_schema" and len(digest) == 32  # the text is ~1 MB
    assert cache_key(StructuredOutput("regex", huge.spec)) != cache_key(huge)


def test_the_tokenizer_info_is_built_off_the_step_loop(monkeypatch):
    import threading

    import xgrammar

    built_on = []
    original = xgrammar.TokenizerInfo.from_huggingface

    def recording(*args, **kwargs):
        built_on.append(threading.current_thread())
        return original(*args, **kwargs)

    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", recording)
    fresh = Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=64, max_num_seqs=4))
    texts, outputs = run(fresh, {1: SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                                   structured=StructuredOutput("regex", "[xyz]{3}"))})
    assert len(built_on) == 1 and built_on[0] is not threading.current_thread()
    assert outputs[1][-1].finish_reason == "stop" and len(texts[1]) == 3


def test_an_abandoned_compile_is_dropped_and_a_slow_one_is_refused_in_time(engine):
    grammars = engine.grammars
    slow = StructuredOutput("json_schema", json.dumps({"enum": [f"value-{i:05d}" for i in range(20000)]}))
    engine.add_request(AddRequest(700, [5, 6, 7], SamplingParams(max_tokens=20, structured=slow)))
    engine.abort([700])  # its only requester left: nobody waits for this compile any more
    assert not grammars._compiles and grammars.num_waiting == 0
    # a tiny constraint does not queue behind it
    texts, outputs = run(engine, {701: SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                                                      structured=StructuredOutput("regex", "[pq]{2}-abandon"))})
    assert outputs[701][-1].finish_reason == "stop" and texts[701].endswith("-abandon")
    saved = grammars.compile_timeout
    grammars.compile_timeout = 0.05
    try:
        _, outputs = run(engine, {702: SamplingParams(max_tokens=20, structured=slow)})
    finally:
        grammars.compile_timeout = saved
    [only] = outputs[702]
    assert only.finish_reason == "abort" and only.token_ids == []
    assert only.error == "The output constraint did not compile within 0.05 s (--grammar-compile-timeout)."


def test_an_ambiguous_grammar_past_its_step_budget_ends_with_an_error_and_its_neighbour_runs_on(engine):
    ambiguous = StructuredOutput("grammar", 'root ::= x\nx ::= x x | "a" | ""')
    texts, outputs = run(engine, {
        800: SamplingParams(max_tokens=2000, temperature=1.0, seed=1, ignore_eos=True, structured=ambiguous),
        801: SamplingParams(max_tokens=400, temperature=1.0, seed=2, ignore_eos=True)})
    last = outputs[800][-1]
    assert last.finish_reason == "abort" and last.token_ids == []
    assert last.error.startswith("The output constraint is too costly to follow"), last.error
    assert set(texts[800]) <= {"a"} and len(outputs[800]) < 2000
    assert outputs[801][-1].finish_reason == "length" and sum(len(o.token_ids) for o in outputs[801]) == 400


def test_a_constraint_only_a_control_character_can_continue_ends_with_an_error_not_a_stop(engine):
    control = StructuredOutput("json_schema", json.dumps({"type": "string", "pattern": "^\\x01$"}))
    texts, outputs = run(engine, {900: SamplingParams(max_tokens=8, temperature=1.0, seed=1, structured=control)})
    last = outputs[900][-1]
    assert last.finish_reason == "abort" and last.token_ids == []
    assert last.error == "The output constraint cannot be met: no token this model can produce continues it."
    assert texts[900] == '"'
