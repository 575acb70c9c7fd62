"""The CUDA branch of quantized loading, run on CPU: every int8/int4 Linear through the Triton kernel (under the
interpreter here, compiled on a GPU), the model's logits equal to transformers' on the dequantized weights
within 1e-3 and its greedy tokens the same, for a compressed-tensors W4A16 checkpoint with zero points and for
--quantization int8 at load.

``quantized_linear.int_kernel`` answers "triton" for a CUDA device; here it is made to answer it for the CPU,
which is the only difference from a GPU load (the loader's check and ``Linear.pack`` both ask it)."""

from __future__ import annotations

import os

import pytest
import torch

from hf_models import hf_greedy, load_hf_model, make_hf_model
from paged_batch import greedy_tokens, prompt_logits
from tidal.gpu.model import quantized_linear
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.loader import load_model, quantized_weights_note
from tidal.gpu.model.quantization import ON_THE_FLY, quantize

pytest.importorskip("compressed_tensors")
from quantized_checkpoints import write_compressed  # noqa: E402 - needs compressed_tensors

PROMPT = [0, 1013, 318, 2047, 57, 4000, 911, 12, 8000, 333, 77]
NEW_TOKENS = 4
SIZES = dict(hidden_size=128, head_dim=32, intermediate_size=256)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def triton_linears(monkeypatch):
    monkeypatch.setattr(quantized_linear, "int_kernel", lambda device: "triton")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"), seed=3, **SIZES)


def assert_matches_transformers(model, config, reference_dir: str) -> None:
    hf = load_hf_model(reference_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, config, PROMPT).cpu(), expected, rtol=0, atol=1e-3)
    tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert greedy_tokens(model, config, PROMPT, NEW_TOKENS) == tokens
    assert len(set(tokens)) > 1  # the comparison means something only if the output varies


def triton_linears_of(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "int_packed", None), quantized_linear.TritonInt)]


def load(model_dir: str, quantize_at_load: str | None = None):
    return load_model(model_dir, torch.float32, torch.device(DEVICE), TorchPagedAttention(), quantize=quantize_at_load)


def test_a_w4a16_checkpoint_with_zero_points_runs_on_the_triton_kernel(triton_linears, dense_dir, tmp_path):
    model_dir = write_compressed(dense_dir, tmp_path / "w4a16", "W4A16", "pack-quantized", symmetric=False,
                                 group_size=64)
    model, config = load(model_dir)
    linears = triton_linears_of(model)
    assert len(linears) == 4 * 2 and all(m.int_packed.bits == 4 for m in linears)
    assert "int4 weights" in quantized_weights_note(model)
    assert_matches_transformers(model, config, os.path.join(model_dir, "reference"))


def test_quantization_int8_at_load_runs_on_the_triton_kernel(triton_linears, dense_dir, tmp_path):
    hf = load_hf_model(dense_dir)
    with torch.no_grad():
        for name, module in hf.named_modules():
            if ".layers." in name and name.endswith("_proj"):
                module.weight.copy_(quantize(module.weight, ON_THE_FLY["int8"]).dequantize())
    hf.save_pretrained(tmp_path)
    model, config = load(dense_dir, "int8")
    assert len(triton_linears_of(model)) == 8
    assert_matches_transformers(model, config, str(tmp_path))
