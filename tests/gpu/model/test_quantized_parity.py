"""Quantized models compute what their weights say: tidal (float32 activations, int8/int4 kernel or FP8
dequantized at load) against transformers over the dequantized weights, logits within 1e-3 and the same
greedy tokens; for compressed-tensors checkpoints (made with compressed-tensors' own compressors, the
reference decompressed by compressed-tensors) and for --quantization int8/int4 on a dense checkpoint; w8a8/w4a8
against the same reference with each projection's input rounded to int8 blocks as the kernel rounds it.
Inconsistent or unsupported checkpoints fail to load with a message naming the tensor or the scheme."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import hf_greedy, load_hf_model, make_hf_model
from paged_batch import greedy_tokens, prompt_logits
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.loader import load_model
from tidal.gpu.model.quantization import LM_HEAD, ON_THE_FLY, int_linear_ops, quantize, resolve_on_the_fly

pytest.importorskip("compressed_tensors")
from quantized_checkpoints import write_compressed  # noqa: E402 - needs compressed_tensors

PROMPT = [0, 1013, 318, 2047, 57, 4000, 911, 12, 8000, 333, 77]
NEW_TOKENS = 12
SIZES = dict(hidden_size=128, head_dim=32, intermediate_size=256)  # whole groups of 128 inputs

SCHEMES = {  # name -> (preset, format, weight argument overrides)
    "w4a16": ("W4A16", "pack-quantized", {}),
    "w4a16-asym-g64": ("W4A16", "pack-quantized", {"symmetric": False, "group_size": 64}),
    "w8a16-channel": ("W8A16", "pack-quantized", {"strategy": "channel", "group_size": None}),
    "w8a16-int-quantized": ("W8A16", "int-quantized", {}),
    "fp8": ("FP8", "float-quantized", {}),
    "fp8-channel": ("FP8", "float-quantized", {"strategy": "channel"}),
}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if int_linear_ops("cpu") is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = make_hf_model(arch, tmp_path_factory.mktemp(arch), seed=len(made) + 1, **SIZES)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def compressed_dir(dense_dir, tmp_path_factory):
    def get(arch: str, scheme: str) -> str:
        preset, fmt, overrides = SCHEMES[scheme]
        return write_compressed(dense_dir(arch), tmp_path_factory.mktemp(f"{arch}-{scheme}"), preset, fmt, **overrides)

    return get


def load(model_dir: str, quantize_at_load: str | None = None):
    return load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention(), quantize=quantize_at_load)


def assert_matches_transformers(model, config, reference_dir: str) -> None:
    hf = load_hf_model(reference_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, config, PROMPT), expected, rtol=0, atol=1e-3)
    tokens = hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert greedy_tokens(model, config, PROMPT, NEW_TOKENS) == tokens
    assert len(set(tokens)) > 1  # the comparison means something only if the output varies


def int_linears(model) -> list:
    return [m for m in model.modules() if getattr(m, "int_packed", None) is not None]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_w4a16_checkpoint_matches_transformers(compressed_dir, arch):
    model_dir = compressed_dir(arch, "w4a16")
    model, config = load(model_dir)
    assert len(int_linears(model)) == 4 * 2 and all(m.int_packed.bits == 4 for m in int_linears(model))
    assert_matches_transformers(model, config, os.path.join(model_dir, "reference"))


@pytest.mark.parametrize("scheme", ["w4a16-asym-g64", "w8a16-channel", "w8a16-int-quantized", "fp8", "fp8-channel"])
def test_each_scheme_matches_transformers(compressed_dir, scheme):
    model_dir = compressed_dir("llama", scheme)
    model, config = load(model_dir)
    assert len(int_linears(model)) == (0 if scheme.startswith("fp8") else 8)
    assert_matches_transformers(model, config, os.path.join(model_dir, "reference"))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantization_at_load_matches_transformers_on_the_rounded_weights(dense_dir, tmp_path, scheme):
    """int8 / int4 at load compute what they say: the decoder's weights rounded to the scheme and the LM head to
    int8 per vocabulary row, times the activations as they are."""
    hf = load_hf_model(dense_dir("qwen2"))
    hf.config.tie_word_embeddings = False  # the head is rounded, the embedding table is not
    hf.lm_head.weight = torch.nn.Parameter(hf.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        for name, module in hf.named_modules():
            if ".layers." in name and name.endswith("_proj"):
                module.weight.copy_(quantize(module.weight, ON_THE_FLY[scheme]).dequantize())
        hf.lm_head.weight.copy_(quantize(hf.lm_head.weight, LM_HEAD[16]).dequantize())
    hf.save_pretrained(tmp_path)
    model, config = load(dense_dir("qwen2"), scheme)
    assert len(int_linears(model)) == 8 + 1 and all(m.int_packed.activation_bits == 16 for m in int_linears(model))
    assert_matches_transformers(model, config, str(tmp_path))


def round_activations_to_int8_blocks(module, args):
    """A forward pre-hook giving a Linear its input as w8a8/w4a8 do: int8 blocks of 32, scale max|x| / 127."""
    (x,) = args
    blocks = x.view(*x.shape[:-1], -1, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127) / torch.where(top > 0, top, 1), 0)  # float32, as the kernel rounds
    return ((torch.round(blocks * inverse) * (top / 127)).view_as(x),)


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8"])
def test_int8_activations_match_transformers_rounding_the_same_way(dense_dir, tmp_path, scheme):
    """w8a8 / w4a8 compute what they say: the rounded weights (and the LM head rounded to int8 per row) times the
    activations rounded to int8 blocks (the reference rounds each projection's and the head's input in a hook);
    without the hook the answers would differ."""
    hf = load_hf_model(dense_dir("qwen2"))
    hf.config.tie_word_embeddings = False  # the head is rounded, the embedding table is not
    hf.lm_head.weight = torch.nn.Parameter(hf.model.embed_tokens.weight.detach().clone())
    with torch.no_grad():
        for name, module in hf.named_modules():
            if ".layers." in name and name.endswith("_proj"):
                module.weight.copy_(quantize(module.weight, ON_THE_FLY[scheme]).dequantize())
        hf.lm_head.weight.copy_(quantize(hf.lm_head.weight, LM_HEAD[8]).dequantize())  # int8 per row, as llama.cpp
    hf.save_pretrained(tmp_path)
    model, config = load(dense_dir("qwen2"), scheme)
    assert len(int_linears(model)) == 8 + 1 and all(m.int_packed.activation_bits == 8 for m in int_linears(model))
    reference = load_hf_model(str(tmp_path))
    float_activations = reference(torch.tensor([PROMPT])).logits[0].float().detach()
    for name, module in reference.named_modules():
        if (".layers." in name and name.endswith("_proj")) or name == "lm_head":
            module.register_forward_pre_hook(round_activations_to_int8_blocks)
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0].float()
    got = prompt_logits(model, config, PROMPT)
    # Rounding x is a step function: where tidal's and transformers' float32 inputs (equal to ~1e-7) straddle a
    # rounding boundary, one int8 value differs by one step and moves that row's logits by ~1e-2. So: nearly all
    # logits within 2e-3, none far off, and the rounding of x visible (float activations differ by far more).
    difference = (got - expected).abs()
    assert difference.flatten().quantile(0.9) <= 2e-3 and difference.max() <= 5e-2, difference.max()
    assert (got - float_activations).abs().flatten().quantile(0.9) > 10 * difference.flatten().quantile(0.9)
    tokens = hf_greedy(reference, PROMPT, NEW_TOKENS)
    assert greedy_tokens(model, config, PROMPT, NEW_TOKENS) == tokens and len(set(tokens)) > 1


def test_quantization_at_load_refuses_an_already_quantized_checkpoint(compressed_dir):
    with pytest.raises(ValueError, match="already quantized"):
        load(compressed_dir("llama", "w4a16"), "int8")


def test_a_scale_of_the_wrong_shape_fails_to_load(compressed_dir, tmp_path):
    source = compressed_dir("llama", "w4a16")
    for entry in os.listdir(source):
        if os.path.isfile(os.path.join(source, entry)):
            (tmp_path / entry).write_bytes(open(os.path.join(source, entry), "rb").read())
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:, :1].contiguous()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"down_proj.weight_scale has shape \(128, 1\), expected \(128, 2\)"):
        load(str(tmp_path))


@pytest.mark.parametrize("weights, activations, message", [
    ({"num_bits": 8, "type": "int", "strategy": "channel"}, {"num_bits": 8, "type": "int", "strategy": "token"},
     "unsupported compressed-tensors scheme: int8 W8A8 per channel"),
    ({"num_bits": 2, "type": "int", "strategy": "group", "group_size": 128}, None, "int2 W2A16 group 128"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}, None, "FP4 W4A16 tensor_group 16"),
])
def test_an_unsupported_scheme_is_refused_naming_it(compressed_dir, tmp_path, weights, activations, message):
    source = compressed_dir("llama", "w4a16")
    config = json.loads(open(os.path.join(source, "config.json")).read())
    config["quantization_config"]["config_groups"]["group_0"]["weights"] = weights
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = activations
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load(str(tmp_path))


@pytest.mark.parametrize("scheme", ["w8a8", "w4a8", "int8", "int4"])
def test_a_bf16_models_int8_head_gives_float32_logits_not_rounded_to_bf16(dense_dir, scheme):
    """With bf16 activations (an AVX512-BF16 host's default) the rounded LM head's logits are its float32 sums over
    the bf16 hidden states: the head's int8 weights times the rows (rounded to int8 blocks under w8a8 / w4a8), not
    those sums rounded to bf16 and widened again (a bf16 logit is off by up to 1/256 of its size: ties and top-p
    cut-offs move)."""
    model, config = load_model(dense_dir("llama"), torch.bfloat16, torch.device("cpu"), TorchPagedAttention(),
                               quantize=scheme)
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    checkpoint = load_file(os.path.join(dense_dir("llama"), "model.safetensors"))
    dense = checkpoint.get("lm_head.weight", checkpoint["model.embed_tokens.weight"])  # tied or not
    activation_bits = ON_THE_FLY[scheme].activation_bits
    weight = quantize(dense.to(torch.bfloat16), LM_HEAD[activation_bits]).dequantize().float()  # rounded as at load
    if activation_bits == 8:
        (rows,) = round_activations_to_int8_blocks(None, (hidden.float(),))
    else:
        rows = hidden.float()
    expected = rows @ weight.T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(logits, logits.bfloat16().float())  # finer than bf16


@pytest.mark.parametrize("name, dtype, device, runs_as", [
    ("int8", "auto", "cpu", "w8a8"), ("int4", "auto", "cpu", "w4a8"),  # the faster kernel, as asked for by auto
    ("int4", "float32", "cpu", "int4"), ("int4", "bfloat16", "cpu", "int4"),  # a named dtype: exact activations
    ("int4", "auto", "cuda", "int4"),  # the Triton kernel is weight-only
    ("w8a8", "float32", "cpu", "w8a8"), ("fp8", "auto", "cuda", "fp8"), (None, "auto", "cpu", None),
])
def test_which_scheme_a_quantization_flag_runs_as(name, dtype, device, runs_as):
    scheme, why = resolve_on_the_fly(name, dtype, torch.device(device))
    assert scheme == runs_as
    assert bool(why) == (runs_as != name) and (not why or f"--quantization {name} runs as {runs_as}" in why)
