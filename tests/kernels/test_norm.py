from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from tidal.kernels.norm import rms_norm, rms_norm_reference

EPS = 1e-5


@pytest.mark.parametrize("hidden_size", [64, 96])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_matches_reference(hidden_size, dtype, with_residual, tolerances):
    x = torch.randn(5, hidden_size).mul(3).to(dtype)
    weight = torch.rand(hidden_size).add(0.5).to(dtype)
    residual = torch.randn(5, hidden_size).to(dtype) if with_residual else None

    out, residual_out = rms_norm(x, weight, EPS, residual)
    expected_out, expected_residual = rms_norm_reference(x, weight, EPS, residual)

    assert out.dtype == dtype and residual_out.dtype == dtype
    torch.testing.assert_close(out, expected_out, **tolerances[dtype])
    # x + residual rounded once to the model dtype; the interpreter rounds fp32 -> bf16 toward
    # zero where the GPU and torch round to nearest, so bf16 may differ by one ulp here
    torch.testing.assert_close(residual_out, expected_residual, **tolerances[dtype])


def test_without_residual_the_residual_out_is_x():
    x = torch.randn(3, 64)
    _, residual_out = rms_norm(x, torch.ones(64), EPS)
    assert torch.equal(residual_out, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_llama_add_then_norm(dtype):
    hidden_size = 64
    norm = LlamaRMSNorm(hidden_size, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden_size) + 0.5)
    norm = norm.to(dtype)
    x = torch.randn(4, hidden_size).to(dtype)
    residual = torch.randn(4, hidden_size).to(dtype)

    out, residual_out = rms_norm_reference(x, norm.weight.detach(), EPS, residual)

    hf_residual = residual + x  # HF decoder layer: hidden_states = residual + hidden_states
    with torch.no_grad():
        hf_out = norm(hf_residual)
    assert torch.equal(residual_out, hf_residual)
    # HF rounds to bf16 before multiplying by the weight; we round once after: <= 1 bf16 ulp apart
    tolerance = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(out, hf_out, **tolerance)
