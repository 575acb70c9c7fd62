"""The model's RMSNorm and rotary on the Triton kernels (their CUDA path) give what their torch path gives."""

from __future__ import annotations

import pytest
import torch

import tidal.kernels
from tidal.gpu.model.layers import RMSNorm, RotaryEmbedding


def _layers(cls, *args):
    """The torch path and the kernel path of one layer, with the same weights."""
    torch_path, kernel_path = cls(*args), cls(*args)
    torch_path._ops = kernel_path._ops = None  # not the CPU C++ ops
    torch_path._kernels, kernel_path._kernels = None, tidal.kernels
    return torch_path, kernel_path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_on_the_kernel_adds_in_place_and_norms_like_torch(dtype, tolerances):
    device = torch.empty(0).device  # cuda when the kernels run compiled there
    torch_norm, kernel_norm = _layers(RMSNorm, 256, 1e-5, dtype, device)
    with torch.no_grad():
        torch_norm.weight.copy_(torch.rand(256).to(dtype))
        kernel_norm.weight.copy_(torch_norm.weight)
    x = torch.randn(5, 256).to(dtype)
    residual = torch.randn(5, 256).to(dtype)
    torch_residual, kernel_residual = residual.clone(), residual.clone()

    expected = torch_norm.add_norm(torch_residual, x)
    got = kernel_norm.add_norm(kernel_residual, x)

    torch.testing.assert_close(kernel_residual, torch_residual, **tolerances[dtype])  # residual += x
    # one rounding in the kernel against HF's two (before and after the weight) in bf16
    torch.testing.assert_close(got, expected, **tolerances[dtype])
    torch.testing.assert_close(kernel_norm(x), torch_norm(x), **tolerances[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_the_kernel_rotates_like_torch(dtype, tolerances):
    device = torch.empty(0).device
    torch_rotary, kernel_rotary = _layers(RotaryEmbedding, 64, 500000.0, None, dtype, device)
    positions = torch.tensor([0, 3, 1000, 77])
    qkv = torch.randn(4, (4 + 2 * 2) * 64).to(dtype)
    q, k, _ = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=1)
    q, k = q.view(4, 4, 64), k.view(4, 2, 64)  # strided views, as the model passes them
    cos, sin = torch_rotary.cos_sin(positions, dtype)

    expected = torch_rotary.rotate(q.clone(), k.clone(), cos, sin)
    got = kernel_rotary.rotate(q, k, cos, sin)

    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **tolerances[dtype])
