"""The fused CPU layer ops (csrc/layer_ops.cpp) compute what the torch ops they replace compute.

In bfloat16 they round where torch rounds, so rotary matches bit for bit and the norm and
SiLU-and-mul agree to within two bf16 steps (a different summation order or exp can tip the
first of their two roundings); in float32 they agree to float32 noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.gpu.cpu import kernels as cpu_kernels
from tidal.gpu.model.layers import apply_rotary, rotary_inv_freq

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    loaded = cpu_kernels.load_cpu_ops()
    if loaded is None:
        pytest.skip("the C++ kernels could not be built here (see the logged warning)")
    return loaded


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.bfloat16:  # at most two bf16 steps (2^-7 relative each) apart, anywhere
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-6, atol=1e-6)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 rows: split over threads
def test_add_rms_norm_matches_add_then_norm(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 768, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, 768, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(768, generator=gen)).to(dtype)
    expected_sum = residual + x
    close(ops.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))
    out = ops.add_rms_norm_(residual, x, weight, 1e-5)
    assert torch.equal(residual, expected_sum)  # the stream itself is exact: one rounded add
    close(out, hf_rms_norm(expected_sum, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_per_head_views(ops, dtype):
    """Qwen3's q/k norm: a [T, H, D] view into the fused qkv output (rows not evenly strided)."""
    qkv = torch.randn(5, 3 * 4 * 16).to(dtype)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    weight = torch.rand(16).to(dtype)
    close(ops.rms_norm(q, weight, 1e-6), hf_rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_rotate_half(ops, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, dim = 9, 4, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, _ = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    untouched_v = qkv[:, (heads + kv_heads) * dim :].clone()
    ops.rotary_(q, k, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    else:
        close(q, expected_q)
        close(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], untouched_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_angles_match_the_torch_angles(ops, dtype):
    """cos/sin [T, D] of float(position) * inv_freq, each half repeated: what RotaryEmbedding's torch ops give,
    within an ulp of float32 (glibc's sincosf against torch's vectorised cos and sin)."""
    inv_freq = rotary_inv_freq(64, 500000.0, None)
    positions = torch.tensor([0, 1, 2, 7, 127, 128, 4095, 131071], dtype=torch.int64)
    cos, sin = ops.rotary_angles(positions, inv_freq, dtype)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    assert cos.dtype == sin.dtype == dtype and cos.shape == sin.shape == (8, 64)
    close(cos, emb.cos().to(dtype))
    close(sin, emb.sin().to(dtype))
    assert torch.equal(cos[:, :32], cos[:, 32:]) and torch.equal(sin[:, :32], sin[:, 32:])
    assert torch.equal(cos[0], torch.ones(64, dtype=dtype)) and torch.equal(sin[0], torch.zeros(64, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_silu_and_mul_matches_torch(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 2048, generator=gen) * 4).to(dtype)
    x[0, :8] = torch.tensor([-100.0, -87.5, -20.0, -0.0, 0.0, 20.0, 88.0, 1000.0])  # far tails stay finite
    gate, up = x.split(2048, dim=-1)
    out = ops.silu_and_mul(x)
    assert torch.isfinite(out).all()
    close(out, F.silu(gate) * up)


def test_rejects_other_dtypes(ops):
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.silu_and_mul(torch.zeros(2, 16, dtype=torch.float16))
