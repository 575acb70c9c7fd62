"""A quantized model through a real server and the openai SDK: a compressed-tensors W4A16 checkpoint
answers with transformers' greedy tokens on its decompressed weights; --quantization int8 says what it
does on the engine-ready line; a flag that contradicts the checkpoint stops the start with the reason."""

from __future__ import annotations

import os

import openai
import pytest
import torch

from hf_models import hf_greedy, load_hf_model, make_hf_model
from live_server import LiveServer

pytest.importorskip("compressed_tensors")
from quantized_checkpoints import write_compressed  # noqa: E402 - needs compressed_tensors

PROMPT = [5, 300, 41, 1200, 77, 9, 640]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def w4a16_dir(tmp_path_factory):
    dense = make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"), seed=5, hidden_size=128, head_dim=32,
                          intermediate_size=256)
    return write_compressed(dense, tmp_path_factory.mktemp("qwen2-w4a16"), "W4A16", "pack-quantized")


def test_a_w4a16_checkpoint_serves_transformers_greedy_tokens(w4a16_dir):
    expected = hf_greedy(load_hf_model(os.path.join(w4a16_dir, "reference")), PROMPT, MAX_TOKENS)
    with LiveServer("--model", w4a16_dir, "--served-model-name", "m", "--num-kv-blocks", "64",
                    "--dtype", "float32") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        completion = client.completions.create(model="m", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                               logprobs=1)
        assert "int4 weights:" in server.log() and "quantized +" in server.log()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(w4a16_dir)
    assert completion.choices[0].text == tokenizer.decode(expected, skip_special_tokens=True)
    assert len(set(expected)) > 1


@pytest.mark.parametrize("flags, weights, ran_as", [
    # --dtype auto on a CPU: int8 activations (w8a8 / w4a8), the faster kernel
    (["--quantization", "int8"], "int8 weights (int8 activations)", "w8a8"),
    (["--quantization", "int4"], "int4+int8 weights (int8 activations)", "w4a8"),
    (["--quantization", "int4", "--dtype", "float32"], "int4+int8 weights", "int4"),  # a named dtype: exact
    (["--quantization", "w4a8"], "int4+int8 weights (int8 activations)", "w4a8"),
])
def test_quantization_at_load_is_on_the_ready_line(flags, weights, ran_as):
    with LiveServer("--model", "tidal-tiny", *flags, "--num-kv-blocks", "64") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
        completion = client.completions.create(model="tidal-tiny", prompt="Hello", max_tokens=4, temperature=0)
        assert completion.choices[0].finish_reason in ("length", "stop")
        assert completion.usage.completion_tokens == 4 or completion.choices[0].finish_reason == "stop"
        # the LM head is rounded to int8 per row: the line names both formats, and the activations when rounded
        assert f"; {weights}: " in server.log()
        asked = flags[1]
        assert (f"--quantization {asked} runs as {ran_as}" in server.log()) == (asked != ran_as)


def test_quantizing_an_already_quantized_checkpoint_stops_the_start(w4a16_dir):
    server = LiveServer("--model", w4a16_dir, "--quantization", "int8", "--num-kv-blocks", "64")
    with pytest.raises(RuntimeError, match="already quantized"):
        server.start()
    server.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU with FP8 would run it")
def test_fp8_without_a_gpu_stops_the_start_in_one_line():
    server = LiveServer("--model", "tidal-tiny", "--quantization", "fp8", "--num-kv-blocks", "64")
    with pytest.raises(RuntimeError, match=r"--quantization fp8 needs a CUDA GPU with FP8 \(compute capability 8\.9\+\)"):
        server.start()
    server.stop()
