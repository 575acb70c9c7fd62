"""GGUF files compute what their tensors say: a model written as llama.cpp writes it (``gguf``'s writer and
quantizer, q/k rows permuted for Llama), loaded by tidal with float32 activations, against transformers over the
same weights dequantized by ``gguf`` itself: logits within 1e-3 and the same greedy tokens, for each architecture
and each type (Q8_0 / Q4_0 / Q4_1 natively on the int kernel; F16 dense; Q5_0 and a K-quant dequantized). A file
whose tensors contradict its metadata, or hold a type tidal does not load, is refused naming the tensor."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from gguf_files import reference_state_dict, write_gguf
from hf_models import hf_greedy, load_hf_model, make_hf_model
from paged_batch import greedy_tokens, prompt_logits
from tidal.gguf_model import write_model_files
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.gguf_checkpoint import unpack
from tidal.gpu.model.loader import load_model, quantized_weights_note
from tidal.gpu.model.quantization import PackedInt, gguf_activation_bits, int_linear_ops

PROMPT = [0, 1013, 318, 2047, 57, 4000, 911, 12, 8000, 333, 77]
NEW_TOKENS = 12
SIZES = dict(hidden_size=128, head_dim=32, intermediate_size=256)  # whole blocks of 32 (and of 256 for K-quants)


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_hf_model(arch, tmp_path_factory.mktemp(arch), seed=len(made) + 1, **SIZES)
        return made[arch]

    return get


def gguf_model_dir(tmp_path, hf_dir: str, linear_type: str, **kwargs) -> str:
    path = write_gguf(hf_dir, str(tmp_path / "model.gguf"), linear_type, **kwargs)
    out = tmp_path / "prepared"
    out.mkdir()
    write_model_files(path, str(out))
    return str(out)


def load(model_dir: str):
    return load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention())


def reference_dir(tmp_path, hf_dir: str, state: dict) -> str:
    hf = load_hf_model(hf_dir)
    hf.load_state_dict(state, strict=False)
    hf.save_pretrained(tmp_path / "reference")
    return str(tmp_path / "reference")


def assert_matches_transformers(model, config, reference: str) -> None:
    hf = load_hf_model(reference)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, config, PROMPT), expected, rtol=0, atol=1e-3)
    tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert greedy_tokens(model, config, PROMPT, NEW_TOKENS) == tokens
    assert len(set(tokens)) > 1  # the comparison means something only if the output varies


def int_linears(model) -> list:
    return [m for m in model.modules() if getattr(m, "int_packed", None) is not None]


needs_kernel = pytest.mark.skipif(int_linear_ops("cpu") is None,
                                  reason="the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_q4_1_file_of_each_architecture_matches_transformers(dense_dir, tmp_path, arch):
    model, config = load(gguf_model_dir(tmp_path, dense_dir(arch), "Q4_1"))
    assert len(int_linears(model)) == 4 * 2 and all(m.int_packed.bits == 4 for m in int_linears(model))
    assert "Q4_1 x14 native int4 group 32 + min" in quantized_weights_note(model)
    assert_matches_transformers(model, config, reference_dir(tmp_path, dense_dir(arch), reference_state_dict(
        dense_dir(arch), "Q4_1")))


@needs_kernel
@pytest.mark.parametrize("kind, bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_q8_0_and_q4_0_files_run_natively_and_match_transformers(dense_dir, tmp_path, kind, bits):
    model, config = load(gguf_model_dir(tmp_path, dense_dir("llama"), kind, embedding_type=kind))
    assert len(int_linears(model)) == 8 and all(m.int_packed.bits == bits for m in int_linears(model))
    note = quantized_weights_note(model)
    assert f"{kind} x14 native int{bits} group 32" in note and f"{kind} x1 dequantized" in note  # the embedding
    assert_matches_transformers(model, config, reference_dir(tmp_path, dense_dir("llama"), reference_state_dict(
        dense_dir("llama"), kind, embedding_type=kind)))


@needs_kernel
@pytest.mark.parametrize("kind, bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_a_tied_head_multiplies_the_files_quantized_embedding(dense_dir, tmp_path, kind, bits):
    model, config = load(gguf_model_dir(tmp_path, dense_dir("qwen3"), "Q4_1", embedding_type=kind))
    head = model._packed_lm_head.int_packed  # the embedding table itself stays dense for the lookup
    assert isinstance(head, PackedInt) and (head.bits, head.group_size) == (bits, 32)
    assert f"{kind} x1 dequantized embedding, native int{bits} group 32 head" in quantized_weights_note(model)
    assert_matches_transformers(model, config, reference_dir(tmp_path, dense_dir("qwen3"), reference_state_dict(
        dense_dir("qwen3"), "Q4_1", embedding_type=kind)))


@pytest.mark.parametrize("kind", ["F16", "BF16", "Q5_0", "Q5_1"])
def test_dense_and_dequantized_types_match_transformers(dense_dir, tmp_path, kind):
    model, config = load(gguf_model_dir(tmp_path, dense_dir("qwen3"), kind))
    assert not int_linears(model)
    assert f"{kind} x14 {'dense' if kind in ('F16', 'BF16') else 'dequantized'}" in quantized_weights_note(model)
    state = reference_state_dict(dense_dir("qwen3"), "F32")
    for name in state:
        if name.endswith("_proj.weight"):
            data = gguf.quants.quantize(state[name].numpy(), gguf.GGMLQuantizationType[kind])
            state[name] = torch.from_numpy(
                gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).astype(np.float32)).reshape(state[name].shape)
    assert_matches_transformers(model, config, reference_dir(tmp_path, dense_dir("qwen3"), state))


def q6_k_blocks(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    """Valid Q6_K bytes (210 per 256 weights: ql, qh, int8 scales, float16 d last) with small random values."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, columns // 256, 210), dtype=np.uint8)
    blocks[:, :, 192:208] = rng.integers(1, 16, size=(rows, columns // 256, 16), dtype=np.uint8)  # scales > 0
    blocks[:, :, 208:210] = np.full((rows, columns // 256, 1), 0.0005, dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def test_a_k_quant_tensor_is_dequantized_by_gguf(dense_dir, tmp_path):
    """Q6_K (what llama.cpp gives most output layers): dequantized at load, exactly as gguf dequantizes it."""
    hf_dir = dense_dir("llama")
    blocks = q6_k_blocks(128, 256)  # ffn_down is [hidden, intermediate] = [128, 256]: one block of 256 a row
    model, config = load(gguf_model_dir(tmp_path, hf_dir, "F32", tensors={"blk.1.ffn_down.weight": (blocks, "Q6_K")}))
    assert "Q6_K x1 dequantized" in quantized_weights_note(model)
    state = reference_state_dict(hf_dir, "F32")
    state["model.layers.1.mlp.down_proj.weight"] = torch.from_numpy(
        gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).astype(np.float32))
    assert_matches_transformers(model, config, reference_dir(tmp_path, hf_dir, state))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_the_int_kernel_multiplies_the_files_exact_values(kind):
    """The repacked group-32 weights stand for exactly gguf's dequantized values, and the kernel multiplies them."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).numpy()
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    weight = unpack(kind, data, (40, 96))
    expected = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]))
    assert torch.equal(weight.dequantize(), expected)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    got = PackedInt(weight, int_linear_ops("cpu")).linear(x, None)
    torch.testing.assert_close(got, x @ expected.T, rtol=0, atol=1e-4)


def refusal(tmp_path, hf_dir: str, **kwargs) -> str:
    with pytest.raises(ValueError) as error:
        load(gguf_model_dir(tmp_path, hf_dir, "F32", **kwargs))
    message = str(error.value)
    assert "\n" not in message
    return message


def test_a_tensor_of_the_wrong_shape_is_refused_naming_it(dense_dir, tmp_path):
    wrong = np.zeros((96, 128), dtype=np.float32)  # attn_k is [kv heads * head_dim, hidden] = [64, 128]
    message = refusal(tmp_path, dense_dir("qwen2"), tensors={"blk.0.attn_k.weight": (wrong, "F32")})
    assert "blk.0.attn_k.weight" in message and "(96, 128)" in message and "(64, 128)" in message


def test_a_type_tidal_does_not_load_is_refused_naming_tensor_and_type(dense_dir, tmp_path):
    iq2 = np.zeros((128, 256 // 256 * 66), dtype=np.uint8)  # IQ2_XXS: 66 bytes per 256 weights
    message = refusal(tmp_path, dense_dir("qwen2"), tensors={"blk.1.ffn_down.weight": (iq2, "IQ2_XXS")})
    assert "blk.1.ffn_down.weight" in message and "IQ2_XXS" in message


def test_a_metadata_layer_count_the_tensors_contradict_is_refused(dense_dir, tmp_path):
    message = refusal(tmp_path, dense_dir("qwen2"), metadata={"block_count": 3})
    assert "blk.2." in message and "lacks" in message
    (tmp_path / "b").mkdir()
    message = refusal(tmp_path / "b", dense_dir("qwen2"), metadata={"block_count": 1})
    assert "blk.1." in message and "no place" in message


@needs_kernel
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_int8_activations_compute_llama_cpps_product(kind):
    """Under ``--dtype auto`` on a CPU the file's integers multiply activations rounded to Q8_0 blocks of 32, as
    llama.cpp's dot products do: the kernel's answer is the file's values times x rounded per 32 inputs to int8 at
    the block's largest magnitude over 127 (Q8_0's rounding; the scale kept in float32 where Q8_0 stores float16)."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).numpy()
    data = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    weight = unpack(kind, data, (40, 96), activation_bits=8)
    expected = torch.from_numpy(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]))
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    blocks = x.view(5, 3, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / scale) * scale).view(5, 96)
    got = PackedInt(weight, int_linear_ops("cpu")).linear(x, None)
    reference = rounded @ expected.T
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-4)
    assert (got - x @ expected.T).abs().max() > 1e-2  # the activations were rounded: not the float product


def test_dtype_auto_on_a_cpu_rounds_a_gguf_files_activations_and_a_named_dtype_keeps_them():
    assert gguf_activation_bits("auto", torch.device("cpu"))[0] == 8
    assert gguf_activation_bits("bfloat16", torch.device("cpu")) == (16, "")
    assert gguf_activation_bits("float32", torch.device("cpu")) == (16, "")
    assert gguf_activation_bits("auto", torch.device("cuda")) == (16, "")


@needs_kernel
def test_a_file_loaded_with_int8_activations_says_so_and_stays_close_to_exact(dense_dir, tmp_path):
    model_dir = gguf_model_dir(tmp_path, dense_dir("llama"), "Q8_0", embedding_type="Q8_0")
    exact, config = load(model_dir)
    rounded, _ = load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention(),
                            gguf_activation_bits=8)
    assert "(int8 activations)" in quantized_weights_note(rounded)
    assert "(int8 activations)" not in quantized_weights_note(exact)
    assert all(m.int_packed.activation_bits == 8 for m in int_linears(rounded))
    a, b = prompt_logits(exact, config, PROMPT), prompt_logits(rounded, config, PROMPT)
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()
