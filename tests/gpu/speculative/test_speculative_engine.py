"""The engine with speculation against itself without, by both methods (n-gram lookup, and a draft model:
tidal-tiny quantized to int4 proposing for tidal-tiny, so most proposals are accepted and some are not):
greedy output token for token the same (text, stops, lengths, logprobs), one output per token, and the
books of what was proposed and accepted.

Rules for determinism: tidal-tiny's weights are fixed; greedy sampling; the prompts repeat themselves so
the n-gram proposer finds its n-grams and the model (which loops) accepts many of them; each test checks
that proposals were accepted, so none passes by never speculating."""

from __future__ import annotations

import time

import pytest
from tokenizers import Tokenizer

from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams, SpeculativeConfig, StructuredOutput

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=4)
DRAFT = SpeculativeConfig("draft_model", num_speculative_tokens=4, model="tidal-tiny", quantization="int4")
TEXTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "Copy this list: apples, pears, plums, apples, pears, plums, apples, pears,",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return",
    "Once upon a time",
]


@pytest.fixture(scope="module", params=[("auto", NGRAM), ("float32", NGRAM), ("auto", DRAFT), ("float32", DRAFT)],
                ids=["auto-ngram", "float32-ngram", "auto-draft", "float32-draft"])
def engines(request):
    """(without, with) speculation, each reused across tests (their requests all end, so they stay clean)."""
    dtype, speculative = request.param
    config = EngineConfig(model="tidal-tiny", dtype=dtype, num_kv_blocks=512, block_size=16)
    return Engine(config), Engine(config.__class__(**{**_fields(config), "speculative": speculative}))


def _fields(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in config.__struct_fields__}


@pytest.fixture(scope="module")
def tokenizer(engines) -> Tokenizer:
    return engines[0].tokenizer


def run(engine: Engine, requests: dict[int, tuple[list[int], SamplingParams, int | None]]) -> dict[int, dict]:
    """Run requests (prompt, params, fork_of) to the end; per request its outputs' fields, in order."""
    for rid, (prompt, params, fork_of) in requests.items():
        engine.add_request(AddRequest(rid, prompt, params, 0, 0.0, fork_of=fork_of))
    got = {rid: {"tokens": [], "text": "", "logprobs": [], "top": [], "outputs": 0, "finish": None, "stop": None}
           for rid in requests}
    deadline = time.monotonic() + 300
    while engine.has_work():
        assert time.monotonic() < deadline, "the requests did not end"
        if not engine.step():
            time.sleep(0.01)  # a grammar compiling: nothing to run yet
        engine.block_manager.check_invariants()
        report = engine.take_report()
        for out in report.outputs if report else ():
            g = got[out.request_id]
            assert len(out.token_ids) <= 1, "one output per token"
            g["tokens"] += out.token_ids
            g["text"] += out.text
            g["outputs"] += 1
            g["finish"], g["stop"] = out.finish_reason, out.stop_reason
            if out.logprobs is not None:
                g["logprobs"] += out.logprobs.token_logprobs
                g["top"] += out.logprobs.top_token_ids
    assert not engine.sequences and engine.block_manager.num_used_blocks == 0
    return got


def assert_same(off: dict, on: dict) -> None:
    for rid in off:
        a, b = off[rid], on[rid]
        assert b["tokens"] == a["tokens"], rid
        assert (b["text"], b["finish"], b["stop"], b["top"]) == (a["text"], a["finish"], a["stop"], a["top"]), rid
        assert b["logprobs"] == pytest.approx(a["logprobs"], abs=2e-3), rid
        assert b["outputs"] == a["outputs"]


def accepted(engine: Engine) -> int:
    return engine.stats().spec_num_accepted_tokens


def test_greedy_output_is_the_same_with_speculation(engines, tokenizer):
    off, on = engines
    before = accepted(on)
    prompts = [tokenizer.encode(t).ids for t in TEXTS]
    requests = {i: (p, SamplingParams(max_tokens=48, temperature=0.0, logprobs=2), None) for i, p in enumerate(prompts)}
    # one at a time and three at once: a batch proposes only into the rows its decodes leave free
    for group in ([0], [1], [2], [3], [0, 1, 2]):
        part = {i: requests[i] for i in group}
        got_off = run(off, part)
        got_on = run(on, {i + 100: r for i, r in part.items()})
        assert_same(got_off, {i: got_on[i + 100] for i in part})
    assert accepted(on) - before >= 20


def test_stops_cut_an_accepted_run_where_they_would_without(engines, tokenizer):
    """A stop string, a stop token id, max_tokens and EOS, each placed where an accepted run passes."""
    off, on = engines
    prompt = tokenizer.encode(TEXTS[0]).ids
    plain = run(off, {1: (prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None)})[1]
    tokens, text = plain["tokens"], plain["text"]
    stop_string = text[len(text) // 2:len(text) // 2 + 3]
    cases = [
        SamplingParams(max_tokens=40, temperature=0.0, stop=(stop_string,)),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(tokens[17],), ignore_eos=True),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.0, stop=("zzz-never",), logprobs=0),
    ]
    before = accepted(on)
    requests = {10 + i: (prompt, params, None) for i, params in enumerate(cases)}
    got_off = run(off, requests)
    got_on = run(on, {k + 100: v for k, v in requests.items()})
    assert_same(got_off, {k: got_on[k + 100] for k in requests})
    assert got_off[10]["stop"] == stop_string and got_off[11]["stop"] == tokens[17]
    assert len(got_off[12]["tokens"]) == 13
    assert accepted(on) - before > 0


def test_choices_of_one_request_are_the_same_with_speculation(engines, tokenizer):
    off, on = engines
    prompt = tokenizer.encode(TEXTS[1]).ids
    params = SamplingParams(max_tokens=32, temperature=0.0)
    requests = {20: (prompt, params, None), 21: (prompt, params, 20), 22: (prompt, params, 20)}
    got_off = run(off, requests)
    got_on = run(on, {k + 100: (p, s, f + 100 if f is not None else None) for k, (p, s, f) in requests.items()})
    assert_same(got_off, {k: got_on[k + 100] for k in requests})


def test_books_of_proposals_add_up(engines, tokenizer):
    _, on = engines
    run(on, {30: (tokenizer.encode(TEXTS[0]).ids, SamplingParams(max_tokens=40, temperature=0.0), None)})
    stats = on.stats()
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert stats.spec_accepted_per_pos == sorted(stats.spec_accepted_per_pos, reverse=True)  # a run is a prefix


def test_the_final_output_carries_the_request_acceptance(engines, tokenizer):
    _, on = engines
    on.add_request(AddRequest(40, tokenizer.encode(TEXTS[0]).ids, SamplingParams(max_tokens=40, temperature=0.0)))
    last = None
    while on.has_work():
        on.step()
        report = on.take_report()
        for out in report.outputs if report else ():
            last = out
    assert last.finish_reason is not None
    assert 0 < last.num_accepted_tokens <= last.num_draft_tokens


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_schema", '{"type":"object","properties":{"a":{"type":"string"}},"required":["a"]}'),
    StructuredOutput("regex", "(ab|cd)+ the (quick|lazy) (fox|dog)[.]"),
], ids=["json_schema", "regex"])
def test_constrained_output_is_valid_and_the_same_with_speculation(engines, tokenizer, structured):
    import json
    import re

    off, on = engines
    prompt = tokenizer.encode(TEXTS[0]).ids
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=structured)
    got_off = run(off, {50: (prompt, params, None)})
    got_on = run(on, {150: (prompt, params, None)})
    assert_same(got_off, {50: got_on[150]})
    text = got_on[150]["text"]
    assert got_on[150]["finish"] in ("stop", "length")  # every token passed the matcher (else "abort")
    if got_on[150]["finish"] == "stop":
        if structured.kind == "json_schema":
            assert isinstance(json.loads(text)["a"], str)
        else:
            assert re.fullmatch(structured.spec, text)


def test_a_reasoning_gate_that_opens_inside_a_proposal(engines, tokenizer, monkeypatch):
    """The gate's ids arrive inside an accepted run: the tokens up to them are free, the grammar holds from
    the next one, as without speculation."""
    import json

    from tidal.gpu import grammar

    off, on = engines
    # tidal-tiny loops on its own output; a prompt holding one turn of the loop has the next turn proposed
    # from it, so the gate (two ids of the turn) completes inside a proposal
    first = tokenizer.encode(TEXTS[0]).ids
    loop = run(off, {59: (first, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None)})[59]["tokens"]
    prompt = first + loop[:20]
    free = run(off, {60: (prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), None)})[60]["tokens"]
    gate = tuple(free[1:3])
    openings = []
    real = grammar._gate_opening

    def spy(seq, draft, gate_ids):
        at = real(seq, draft, gate_ids)
        openings.append((at, len(draft)))
        return at

    monkeypatch.setattr(grammar, "_gate_opening", spy)
    choice = StructuredOutput("choice", json.dumps(["alpha", "beta"]), after=gate)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, structured=choice)
    got_off = run(off, {61: (prompt, params, None)})
    got_on = run(on, {161: (prompt, params, None)})
    assert_same(got_off, {61: got_on[161]})
    assert got_on[161]["text"].endswith(("alpha", "beta")) and got_on[161]["finish"] == "stop"
    assert any(at is not None and 0 < at <= n for at, n in openings), openings  # opened within a proposal
