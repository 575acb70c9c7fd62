"""Tensor parallelism on CPU (gloo) with real rank processes: the same greedy tokens as one rank and
as transformers, served through the openai SDK, a dead rank taking its replica down cleanly, two
"nodes" on loopback, and a clear error for a size that does not split the model.

Float32 throughout: a row-parallel all-reduce sums the same products in a different order than one
rank's matmul, which the tiny test models' logit gaps (tests/hf_models.py) are far above.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from hf_models import hf_greedy, load_hf_model, tokenizer_vocab_size
from live_server import LiveServer, free_port
from tidal.gpu.engine import Engine
from tidal.wire import AddRequest, EngineConfig, SamplingParams

NUM_NEW_TOKENS = 6
# mixed lengths; a batch token budget of 16 makes the long one prefill in chunks beside the decodes
PROMPTS = [[0, 1013, 318, 2047, 57, 4000, 911], list(range(100, 141)), [0, 8]]

CASES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    # one KV head for two ranks (replicated), and a vocabulary that does not split evenly (padded)
    "llama-kv1-odd-vocab": {"num_key_value_heads": 1, "vocab_size": tokenizer_vocab_size() + 1},
}


def run_engine(model_dir: str, tensor_parallel_size: int) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` from an in-process engine; rank 0 is this process."""
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=tensor_parallel_size,
                                 block_size=4, num_kv_blocks=64, max_num_batched_tokens=16))
    try:
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        for rid, prompt in enumerate(PROMPTS):
            engine.add_request(AddRequest(rid, prompt, params, 0, 0.0))
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        while engine.has_work():
            engine.step()
            report = engine.take_report()
            for out in report.outputs if report else ():
                tokens[out.request_id].extend(out.token_ids)
        assert engine.block_manager.num_used_blocks == 0
        return tokens
    finally:
        if engine.runner.tp is not None:
            engine.runner.tp.close()


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_same_greedy_tokens_as_one_and_as_transformers(case, hf_model_dir):
    model_dir = hf_model_dir(case.split("-")[0], seed=list(CASES).index(case), **CASES[case])
    one_rank = run_engine(model_dir, 1)
    two_ranks = run_engine(model_dir, 2)
    hf = load_hf_model(model_dir)
    expected = [hf_greedy(hf, prompt, NUM_NEW_TOKENS) for prompt in PROMPTS]
    assert two_ranks == one_rank == expected


def test_each_rank_holds_only_its_shard(hf_model_dir):
    """Half the heads, half the MLP, half the vocabulary, its own KV heads; the cache sizes agree."""
    from tidal.gpu.model_runner import ModelRunner

    model_dir = hf_model_dir("llama")
    runner = ModelRunner(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=2,
                                      kv_cache_memory_bytes=1 << 20))
    try:
        attn = runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert tuple(attn.qkv_proj.weight.shape) == ((2 + 1 + 1) * 16, 64)
        assert tuple(attn.o_proj.weight.shape) == (64, 2 * 16)
        assert tuple(runner.model.model.layers[0].mlp.down_proj.weight.shape) == (64, 64)
        assert runner.model.model.embed_tokens.shape[0] == -(-tokenizer_vocab_size() // 2)
        assert runner.kv_caches[0][0].shape[2] == 1
        # 1 MiB per rank of 1-head blocks: twice the blocks one rank with both heads would get
        assert runner.num_blocks == (1 << 20) // (2 * 2 * 16 * 1 * 16 * 4)
    finally:
        runner.tp.close()


# ---------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def served_model(tmp_path_factory):
    from hf_models import make_hf_model

    return make_hf_model("qwen3", tmp_path_factory.mktemp("tp-served"))


def rank_pids(engine_pid: int) -> list[int]:
    return [c.pid for c in psutil.Process(engine_pid).children() if "tidal.gpu.tp_worker" in " ".join(c.cmdline())]


def test_a_served_two_rank_request_through_the_openai_sdk(served_model):
    import openai
    from tokenizers import Tokenizer

    with LiveServer("--model", served_model, "--tensor-parallel-size", "2", "--dtype", "float32") as server:
        assert len(rank_pids(server.engine_pid())) == 1
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        prompt = PROMPTS[0]
        completion = client.completions.create(model=served_model, prompt=prompt, max_tokens=NUM_NEW_TOKENS,
                                               temperature=0)
        expected = hf_greedy(load_hf_model(served_model), prompt, NUM_NEW_TOKENS)
        tokenizer = Tokenizer.from_file(os.path.join(served_model, "tokenizer.json"))
        assert completion.choices[0].text == tokenizer.decode(expected)
        assert completion.usage.completion_tokens == NUM_NEW_TOKENS
