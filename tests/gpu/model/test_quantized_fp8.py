"""FP8 linears (quantized_linear.Fp8Linear): weights float8_e4m3fn per output channel, activations per token,
multiplied by ``torch._scaled_mm``. They run on CUDA GPUs with FP8 only; torch 2.13 also has a CPU
``_scaled_mm``, which lets the math and the whole load path run here (``fp8_runs_on`` made to say yes)."""

from __future__ import annotations

import os

import pytest
import torch

from hf_models import make_hf_model
from tidal.gpu.model import quantized_linear
from tidal.gpu.model.attention import TorchPagedAttention
from tidal.gpu.model.loader import load_model, quantized_weights_note, resolve_model_dir
from tidal.gpu.model.quantized_linear import (FP8_REFUSAL, Fp8Linear, Fp8Weight, fp8_linear_reference, quantize_fp8,
                                              quantize_per_token)

E4M3_STEP = 2 ** -3  # 3 mantissa bits: a rounded value is within half a step, relative


def scaled_mm_runs_here() -> bool:
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.T, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError):
        return False
    return True


needs_scaled_mm = pytest.mark.skipif(not scaled_mm_runs_here(),
                                     reason="this torch has no CPU torch._scaled_mm: the FP8 product runs on GPUs only")


def test_weights_round_to_e4m3_per_channel_with_the_largest_at_448():
    weight = torch.randn(40, 70) * torch.logspace(-3, 1, 40)[:, None]  # channels of very different ranges
    fp8 = quantize_fp8(weight)
    assert fp8.q.dtype == torch.float8_e4m3fn and fp8.scales.shape == (40,)
    assert torch.equal(fp8.q.float().abs().amax(dim=1), torch.full((40,), 448.0))
    error = (fp8.dequantize() - weight).abs()
    assert torch.all(error <= weight.abs() * E4M3_STEP / 2 + fp8.scales[:, None] * 2 ** -9)  # subnormals: 2^-9


def test_activations_quantize_per_token():
    rows = torch.randn(3, 50) * torch.tensor([[1e-3], [1.0], [1e3]])
    q, scales = quantize_per_token(rows)
    assert scales.shape == (3, 1)
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((3,), 448.0))
    torch.testing.assert_close(q.float() * scales, rows, rtol=E4M3_STEP / 2, atol=0)
    zero_q, zero_scales = quantize_per_token(torch.zeros(1, 8))  # an all-zero row stays zero, not NaN
    assert torch.equal(zero_q.float(), torch.zeros(1, 8)) and torch.isfinite(zero_scales).all()


@needs_scaled_mm
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n, k", [(48, 64), (37, 53)])  # odd shapes are padded to _scaled_mm's multiples of 16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_linear_matches_its_reference(m, n, k, dtype):
    weight = quantize_fp8(torch.randn(n, k) * 0.05)
    x, bias = torch.randn(m, k).to(dtype), torch.randn(n).to(dtype)

    out = Fp8Linear(weight).linear(x, bias)

    assert out.shape == (m, n) and out.dtype == dtype
    # the product leaves _scaled_mm in bf16 (row-wise scales): one bf16 rounding from the fp32 reference
    torch.testing.assert_close(out.float(), fp8_linear_reference(x, weight, bias).float(), rtol=1e-2, atol=1e-2)
    # and the whole FP8 approximation stays close to the dense product
    dense = x.float() @ weight.dequantize().T + bias.float()
    assert (out.float() - dense).norm() / dense.norm() < 0.05


def test_fp8_at_load_is_refused_on_a_cpu_in_one_line():
    with pytest.raises(ValueError) as refusal:
        load_model(resolve_model_dir("tidal-tiny"), torch.float32, torch.device("cpu"), TorchPagedAttention(), quantize="fp8")
    assert str(refusal.value) == FP8_REFUSAL == "--quantization fp8 needs a CUDA GPU with FP8 (compute capability 8.9+)"


@pytest.mark.parametrize("capability, runs", [((8, 0), False), ((8, 9), True), ((9, 0), True)])
def test_fp8_needs_compute_capability_8_9(monkeypatch, capability, runs):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert quantized_linear.fp8_runs_on("cuda") is runs
    assert quantized_linear.fp8_runs_on("cpu") is False


@pytest.fixture
def fp8_here(monkeypatch):
    """The CPU stands in for a GPU with FP8: the load path is the same, ``_scaled_mm`` runs on CPU."""
    monkeypatch.setattr(quantized_linear, "fp8_runs_on", lambda device: True)


def fp8_linears(model) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "int_packed", None), Fp8Linear)]


@needs_scaled_mm
def test_quantization_fp8_at_load_runs_every_decoder_linear_in_fp8(fp8_here, tmp_path):
    model_dir = make_hf_model("llama", tmp_path, seed=1, hidden_size=128, head_dim=32, intermediate_size=256)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention(), quantize="fp8")
    linears = fp8_linears(model)
    assert len(linears) == 4 * 2
    note = quantized_weights_note(model)
    assert "fp8 weights" in note
    # 1 byte a weight, plus a float32 scale per output channel (every size here a multiple of 16)
    assert sum(m.int_packed.nbytes for m in linears) == sum(m.int_packed.n * (m.int_packed.k + 4) for m in linears)


@needs_scaled_mm
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_an_fp8_checkpoint_keeps_its_fp8_weights_where_fp8_runs(fp8_here, tmp_path, strategy):
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import write_compressed
    from safetensors.torch import load_file

    dense = make_hf_model("llama", tmp_path / "dense", seed=2, hidden_size=128, head_dim=32, intermediate_size=256)
    model_dir = write_compressed(dense, tmp_path / "fp8", "FP8", "float-quantized", strategy=strategy)
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention())

    tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    attn = model.model.layers[0].self_attn.qkv_proj.int_packed
    parts = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    # the fused q/k/v weight is the checkpoint's FP8 values, each part with its own scale (per tensor: repeated)
    expected = torch.cat([tensors[p + ".weight"] for p in parts]).float()
    assert torch.equal(attn.q[:attn.n, :attn.k].float(), expected)
    scales = torch.cat([tensors[p + ".weight_scale"].float().reshape(-1).expand(tensors[p + ".weight"].shape[0])
                        for p in parts])
    assert torch.equal(attn.scales[0, :attn.n], scales)
    assert len(fp8_linears(model)) == 8


def test_without_fp8_an_fp8_checkpoint_is_dequantized_as_before(tmp_path):
    pytest.importorskip("compressed_tensors")
    from quantized_checkpoints import write_compressed

    dense = make_hf_model("llama", tmp_path / "dense", seed=2, hidden_size=128, head_dim=32, intermediate_size=256)
    model_dir = write_compressed(dense, tmp_path / "fp8", "FP8", "float-quantized")
    model, _ = load_model(model_dir, torch.float32, torch.device("cpu"), TorchPagedAttention())
    assert fp8_linears(model) == [] and quantized_weights_note(model) == ""


def test_fused_fp8_parts_stack_their_scales():
    parts = [quantize_fp8(torch.randn(n, 32)) for n in (16, 8)]
    fused = Fp8Weight.cat(parts)
    assert fused.q.shape == (24, 32) and torch.equal(fused.scales, torch.cat([p.scales for p in parts]))
