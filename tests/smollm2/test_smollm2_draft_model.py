"""The draft_model method on the real model, in process: SmolLM2-135M-Instruct as a bf16 Hugging Face
directory is the target and the same model's Q4_1 GGUF its draft. What a user depends on: greedy output
token for token (and logprob for logprob) what it is without a draft, most proposals accepted (the two
files are one model at two precisions), the books of vLLM's spec metrics adding up, and a draft of another
vocabulary refused with one line before any weights load.

Greedy requests only; max_tokens stays short (the host is a shared 2-core CPU)."""

from __future__ import annotations

import pytest

from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams, SpeculativeConfig

PROMPTS = [
    "Write a short poem about the sea.\n",
    "def fibonacci(n):",
    "The capital of France is Paris. The capital of Italy is",
]


@pytest.fixture(scope="module")
def engines(smollm2_hf_dir, smollm2_dir):
    config = EngineConfig(model=smollm2_hf_dir, num_kv_blocks=128, max_model_len=2048)
    draft = SpeculativeConfig("draft_model", num_speculative_tokens=3, model=smollm2_dir)
    return Engine(config), Engine(EngineConfig(**{**_fields(config), "speculative": draft}))


def _fields(config: EngineConfig) -> dict:
    return {name: getattr(config, name) for name in config.__struct_fields__}


def run(engine: Engine, prompts: list[list[int]], max_tokens: int = 32) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of each prompt's greedy answer, all prompts at once."""
    for rid, prompt in enumerate(prompts):
        engine.add_request(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)))
    got = [([], []) for _ in prompts]
    while engine.has_work():
        engine.step()
        report = engine.take_report()
        for out in report.outputs if report else ():
            got[out.request_id][0].extend(out.token_ids)
            if out.logprobs is not None:
                got[out.request_id][1].extend(out.logprobs.token_logprobs)
    assert engine.block_manager.num_used_blocks == 0  # the draft's cache is in the same blocks: all free
    return got


def test_greedy_output_with_a_draft_is_token_for_token_the_same(engines):
    off, on = engines
    prompts = [off.tokenizer.encode(text).ids for text in PROMPTS]
    for group in ([0], [1, 2]):  # alone, and two at once (the draft's passes batch them)
        part = [prompts[i] for i in group]
        for (tokens_off, lp_off), (tokens_on, lp_on) in zip(run(off, part), run(on, part)):
            assert tokens_on == tokens_off
            assert lp_on == pytest.approx(lp_off, abs=2e-3)
    stats = on.stats()
    # one model at two precisions: most of what the draft proposes is what the target picks
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens >= 0.7 * stats.spec_num_draft_tokens
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens


def test_a_draft_with_another_vocabulary_is_refused_with_one_line(smollm2_dir):
    config = EngineConfig(model="tidal-tiny", speculative=SpeculativeConfig("draft_model", 3, model=smollm2_dir))
    with pytest.raises(ValueError) as refused:
        Engine(config)
    message = str(refused.value)
    assert "vocabulary of 49152 tokens, the target 8192" in message and "\n" not in message
