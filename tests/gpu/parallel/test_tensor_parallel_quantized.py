"""Tensor parallelism over int8/int4 weights (CPU ranks over gloo, real rank processes): each rank holds its
slice of the integers with their scales and zero points, sliced as the dense weight is, and two ranks give
one rank's greedy tokens and logprobs for --quantization int8, int4 and compressed-tensors W4A16 and W8A16
checkpoints. A row-parallel slice that is not whole groups is refused before any rank starts, naming the
layer, the group size and the shard's K.

Float32 activations: the two ranks' partial sums add up to one rank's sum up to float rounding order.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from live_server import LiveServer
from tidal.gpu.engine import Engine
from tidal.gpu.model.quantization import ON_THE_FLY, QuantizedWeight, Scheme, int_linear_ops, quantize
from tidal.wire import AddRequest, EngineConfig, SamplingParams

NUM_NEW_TOKENS = 8
PROMPTS = [[0, 1013, 318, 2047, 57, 4000, 911], list(range(100, 141)), [0, 8]]
# o_proj's 8 x 32 = 256 inputs and the MLP's 256 split over two ranks into whole groups of 32
SPLITS = dict(hidden_size=128, num_attention_heads=8, head_dim=32, intermediate_size=256)
# down_proj's 336 inputs: 168 per rank, five and a quarter int4 groups of 32 (--quantization int4)
MISALIGNED = dict(SPLITS, intermediate_size=336)
# down_proj's 384 inputs: 192 per rank, one and a half groups of 128 (a W4A16 checkpoint's)
MISALIGNED_128 = dict(SPLITS, intermediate_size=384)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if int_linear_ops("cpu") is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """An in-process rank 0 takes its share of the cores (torch.set_num_threads): give them back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_engine(model_dir: str, tensor_parallel_size: int, quantization: str | None = None):
    """Greedy tokens and their top-5 logprobs of ``PROMPTS`` from an in-process engine (rank 0 here), and the
    qkv shard's int weight (for the shapes)."""
    engine = Engine(EngineConfig(model=model_dir, dtype="float32", tensor_parallel_size=tensor_parallel_size,
                                 block_size=4, num_kv_blocks=256, max_num_batched_tokens=16,
                                 quantization=quantization))
    try:
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
        for rid, prompt in enumerate(PROMPTS):
            engine.add_request(AddRequest(rid, prompt, params, 0, 0.0))
        tokens: list[list[int]] = [[] for _ in PROMPTS]
        logprobs: list[list[list[float]]] = [[] for _ in PROMPTS]
        while engine.has_work():
            engine.step()
            report = engine.take_report()
            for out in report.outputs if report else ():
                tokens[out.request_id].extend(out.token_ids)
                logprobs[out.request_id].extend(out.logprobs.top_logprobs)
        layer = engine.runner.model.model.layers[0]
        shapes = {name: (m.int_packed.n, m.int_packed.k, m.int_packed.group_size)
                  for name, m in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                                  ("down", layer.mlp.down_proj))}
        return tokens, torch.tensor(logprobs), shapes
    finally:
        if engine.runner.tp is not None:
            engine.runner.tp.close()


def assert_two_ranks_match_one(model_dir: str, quantization: str | None, group: int | None,
                               kv_heads: int = 2) -> None:
    one_tokens, one_logprobs, one_shapes = run_engine(model_dir, 1, quantization)
    two_tokens, two_logprobs, two_shapes = run_engine(model_dir, 2, quantization)
    assert two_tokens == one_tokens
    assert len({t for tokens in one_tokens for t in tokens}) > 3  # the comparison means something
    torch.testing.assert_close(two_logprobs, one_logprobs, rtol=0, atol=1e-4)
    # rank 0 holds half of each: qkv's query heads and its KV heads (one KV head: a replica of it), o/down's
    # inputs, groups kept
    (n, k, g), (o_n, o_k, o_g) = one_shapes["qkv"], one_shapes["o"]
    head_dim = SPLITS["head_dim"]
    assert two_shapes["qkv"] == (o_k // 2 + 2 * max(kv_heads // 2, 1) * head_dim, k, g)
    assert two_shapes["o"] == (o_n, o_k // 2, o_g if group else o_k // 2)
    assert two_shapes["down"][1] == one_shapes["down"][1] // 2


@pytest.mark.parametrize("quantization, kv_heads", [("int8", 2), ("int4", 1)])
def test_two_ranks_quantizing_their_shards_give_one_ranks_tokens_and_logprobs(quantization, kv_heads, hf_model_dir):
    model_dir = hf_model_dir("llama", seed=3, num_key_value_heads=kv_heads, **SPLITS)
    assert_two_ranks_match_one(model_dir, quantization, ON_THE_FLY[quantization].group_size, kv_heads)


@pytest.mark.parametrize("preset, group, weight_args", [
    ("W4A16", 128, {"symmetric": False}),  # with zero points
    ("W8A16", None, {"strategy": "channel", "group_size": None}),
])
def test_two_ranks_shard_a_checkpoints_integers_scales_and_zero_points(preset, group, weight_args, hf_model_dir,
                                                                       tmp_path):
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import write_compressed

    model_dir = write_compressed(hf_model_dir("qwen2", seed=4, **SPLITS), tmp_path / preset, preset,
                                 "pack-quantized", **weight_args)
    assert_two_ranks_match_one(model_dir, None, group)


# ---------------------------------------------------------------------- shard then quantize


def test_quantizing_a_shard_equals_the_shard_of_the_quantized_weight():
    """Round-to-nearest is local to a channel or group: a column shard, and a row shard on group boundaries
    (per channel: with the whole row's largest magnitude), quantize to the slice of the whole."""
    torch.manual_seed(0)
    weight = torch.randn(48, 512)

    def same(a: QuantizedWeight, b: QuantizedWeight) -> None:
        assert (a.bits, a.group_size) == (b.bits, b.group_size)
        assert torch.equal(a.q, b.q) and torch.equal(a.scales, b.scales)

    int4, int8 = ON_THE_FLY["int4"], ON_THE_FLY["int8"]
    whole4, whole8 = quantize(weight, int4), quantize(weight, int8)
    for start, stop in ((0, 256), (256, 512), (128, 384)):
        same(whole4[:, start:stop], quantize(weight[:, start:stop], int4))
        amax = weight.abs().amax(dim=1, keepdim=True)  # the all-reduce of each rank's max (RowParallelLinear)
        same(whole8[:, start:stop], quantize(weight[:, start:stop], Scheme(8, None), amax))
    for whole, scheme in ((whole4, int4), (whole8, int8)):
        same(whole[16:40], quantize(weight[16:40], scheme))
    # a per-channel row shard keeps the whole scale: each rank's partial sum adds up to the whole product
    x = torch.randn(3, 512)
    halves = sum(x[:, s:s + 256] @ whole8[:, s:s + 256].dequantize().T for s in (0, 256))
    torch.testing.assert_close(halves, x @ whole8.dequantize().T)


def test_a_shard_that_cuts_a_group_is_refused_naming_the_group_and_its_k():
    weight = quantize(torch.randn(16, 256), ON_THE_FLY["int4"])
    with pytest.raises(ValueError, match=r"int4 group 32 .* shard's K is 64 \(inputs 48\.\.112 of 256\)"):
        weight[:, 48:112]
    zero_points = QuantizedWeight(weight.q, weight.scales, torch.zeros_like(weight.scales, dtype=torch.int8), 4, 32)
    assert zero_points[:, 128:256].zero_points.shape == (16, 4)


@pytest.mark.parametrize("source", ["--quantization int4", "W4A16 checkpoint"])
def test_a_split_that_cuts_groups_stops_the_start_in_one_line(source, hf_model_dir, tmp_path):
    model_dir, flags = hf_model_dir("llama", **MISALIGNED), ["--quantization", "int4"]
    scheme = "--quantization w4a8 (int4 W4A8 group 32)"  # what int4 runs as under --dtype auto on a CPU
    inputs, group = 336, 32
    if source == "W4A16 checkpoint":
        pytest.importorskip("compressed_tensors")
        from quantized_checkpoints import write_compressed

        model_dir, flags = write_compressed(hf_model_dir("llama", **MISALIGNED_128), tmp_path / "w4a16", "W4A16",
                                            "pack-quantized"), []
        scheme = "int4 W4A16 group 128 (pack-quantized)"
        inputs, group = 384, 128
    result = subprocess.run([sys.executable, "-m", "tidal", "serve", "--model", model_dir, *flags,
                             "--tensor-parallel-size", "2", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert (f"--tensor-parallel-size 2 gives each rank {inputs // 2} of down_proj's {inputs} inputs (its shard's K), "
            f"not whole groups of {group} of the {scheme} weights") in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("not whole groups") == 1, result.stderr


def test_a_per_channel_split_of_the_same_model_loads(hf_model_dir):
    """int8 has one scale per channel: any split is whole rows of it."""
    tokens, _, shapes = run_engine(hf_model_dir("llama", **MISALIGNED), 2, "int8")
    assert shapes["down"][1:] == (168, 168) and all(len(t) == NUM_NEW_TOKENS for t in tokens)


# ---------------------------------------------------------------------- served


@pytest.mark.slow
def test_a_served_two_rank_int8_model_answers_through_the_openai_sdk(hf_model_dir):
    import openai
    from tokenizers import Tokenizer

    model_dir = hf_model_dir("llama", seed=3, num_key_value_heads=2, **SPLITS)
    expected, _, _ = run_engine(model_dir, 1, "int8")
    with LiveServer("--model", model_dir, "--served-model-name", "m", "--tensor-parallel-size", "2",
                    "--quantization", "int8", "--dtype", "float32", "--num-kv-blocks", "64") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        completion = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=NUM_NEW_TOKENS,
                                               temperature=0, logprobs=1)
        assert "int8 weights:" in server.log() and "read per step by each of 2 ranks" in server.log()
    assert completion.usage.completion_tokens == NUM_NEW_TOKENS
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    assert completion.choices[0].text == tokenizer.decode(expected[0])
