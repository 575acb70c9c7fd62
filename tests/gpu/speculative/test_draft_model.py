"""What the draft_model method adds over n-gram lookup, on tidal-tiny: the draft's KV cache is paid for out
of the same --kv-cache-memory (fewer blocks, one table), the draft catches up on a prompt longer than one
step's token budget chunk by chunk and the output stays the same, and a draft whose tokenizer differs from
the target's (with the same vocabulary size) is refused with one line.

Rules for determinism: tidal-tiny's weights are fixed; greedy sampling; the draft is tidal-tiny itself, so
its proposals are accepted (each test checks they were)."""

from __future__ import annotations

import json
import shutil

import pytest

from tidal.gpu.engine import Engine
from tidal.gpu.model.tiny_model import asset_dir
from tidal.wire import AddRequest, EngineConfig, SamplingParams, SpeculativeConfig

DRAFT = SpeculativeConfig("draft_model", num_speculative_tokens=3, model="tidal-tiny")
TEXT = "def add(a, b):\n    return a + b\n\n" * 12


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    engine.add_request(AddRequest(1, prompt, params))
    tokens = []
    while engine.has_work():
        engine.step()
        engine.block_manager.check_invariants()
        report = engine.take_report()
        tokens += [t for out in (report.outputs if report else ()) for t in out.token_ids]
    assert engine.block_manager.num_used_blocks == 0
    return tokens


def test_the_drafts_cache_is_paid_from_the_same_memory():
    memory = 1 << 22
    alone = Engine(EngineConfig(model="tidal-tiny", kv_cache_memory_bytes=memory)).ready_message()
    shared = Engine(EngineConfig(model="tidal-tiny", kv_cache_memory_bytes=memory, speculative=DRAFT)).ready_message()
    # the draft is the target's twin: each block holds both models' K/V, so half as many fit
    assert shared.num_total_blocks == alone.num_total_blocks // 2


def test_a_prompt_longer_than_a_steps_budget_is_caught_up_in_chunks():
    config = EngineConfig(model="tidal-tiny", num_kv_blocks=128, max_num_batched_tokens=64)
    off, on = Engine(config), Engine(EngineConfig(**{**_fields(config), "speculative": DRAFT}))
    prompt = off.tokenizer.encode(TEXT).ids
    assert len(prompt) > 2 * 64
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    assert run(on, prompt, params) == run(off, prompt, params)
    stats = on.stats()
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_sampled_requests_are_verified_against_a_greedy_draft():
    """A sampling request accepts a proposed token with the target's probability of it: it runs, its
    tokens count, and with the draft being the target the likely tokens are mostly accepted."""
    on = Engine(EngineConfig(model="tidal-tiny", num_kv_blocks=128, speculative=DRAFT))
    prompt = on.tokenizer.encode(TEXT[:40]).ids
    tokens = run(on, prompt, SamplingParams(max_tokens=40, temperature=0.3, seed=7, ignore_eos=True))
    assert len(tokens) == 40
    assert on.stats().spec_num_accepted_tokens > 0


def test_a_draft_with_another_tokenizer_is_refused_with_one_line(tmp_path):
    draft = tmp_path / "other-tokenizer"
    shutil.copytree(asset_dir(), draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]  # the same size, two tokens' ids swapped
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError) as refused:
        Engine(EngineConfig(model="tidal-tiny", speculative=SpeculativeConfig("draft_model", 3, model=str(draft))))
    message = str(refused.value)
    assert "has another tokenizer than the target" in message and "\n" not in message


def _fields(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in config.__struct_fields__}
