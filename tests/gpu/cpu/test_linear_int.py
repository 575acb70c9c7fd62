"""The int8/int4 weight-only linear (csrc/linear_int.cpp) computes x @ dequant(W).T + b: against a float64
torch reference over odd and ragged shapes (N not a multiple of 16, K not a multiple of the group, groups not a
multiple of int4's chunk of 8 inputs), per-channel and grouped scales, symmetric and with zero points, 1 to 40
rows, float32 and bf16 activations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantized_checkpoints import with_zero_points
from tidal.gpu.model.quantization import PackedInt, QuantizedWeight, Scheme, int_linear_ops, quantize


@pytest.fixture(scope="module")
def ops():
    loaded = int_linear_ops("cpu")
    if loaded is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")
    return loaded


def assert_matches(out: torch.Tensor, x: torch.Tensor, weight: QuantizedWeight, bias) -> None:
    dense = weight.dequantize().double()
    exact = x.double() @ dense.T + (0 if bias is None else bias.double())
    # the kernel computes q * scale - zero_point * scale (int4: with 8 added to both), each term rounded
    k = weight.q.shape[1]
    terms = weight.q.double().abs() + 8 + (0 if weight.zero_points is None else weight.zero_points.double().abs()
                                           .repeat_interleave(weight.group_size, dim=1)[:, :k])
    per_weight = terms * weight.scales.double().abs().repeat_interleave(weight.group_size, dim=1)[:, :k]
    magnitude = x.double().abs() @ per_weight.T + (0 if bias is None else bias.double().abs())
    bound = magnitude * (x.shape[-1] + 4) * 2.0**-23 + 1e-30
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}"


@settings(max_examples=50, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 90), half_k=st.integers(1, 200), bits=st.sampled_from([8, 4]),
       group=st.sampled_from([None, 6, 32, 34, 128]), symmetric=st.booleans(), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_the_dequantized_weight(ops, m, n, half_k, bits, group, symmetric, with_bias, seed):
    k = 2 * half_k + (1 if bits == 8 and seed % 2 else 0)  # int8 takes odd K too
    generator = torch.Generator().manual_seed(seed)
    weight = quantize(torch.randn(n, k, generator=generator), Scheme(bits, group))
    if not symmetric:
        weight = with_zero_points(weight, seed)
    x = torch.randn(m, k, generator=generator)
    bias = torch.randn(n, generator=generator) if with_bias else None
    out = PackedInt(weight, ops).linear(x, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_matches(out, x, weight, bias)


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_activations_give_a_bf16_result(ops, bits):
    weight = quantize(torch.randn(48, 256), Scheme(bits, 128 if bits == 4 else None))
    x = torch.randn(2, 3, 256).bfloat16()
    bias = torch.randn(48).bfloat16()
    out = PackedInt(weight, ops).linear(x, bias)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    reference = x.float() @ weight.dequantize().T + bias.float()
    assert torch.allclose(out.float(), reference, atol=0.1, rtol=0.02)


def test_quantize_rounds_to_the_nearest_step():
    weight = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q = quantize(weight, Scheme(8, None))
    assert q.q[0].tolist() == [127, -64, 32, 0] and q.q[1].tolist() == [0, 0, 0, 0]
    assert torch.allclose(q.scales[0], torch.tensor([1 / 127]))
    assert (q.dequantize() - weight).abs().max() <= 0.5 / 127


def test_int4_maps_each_groups_signed_extreme_to_minus_8_as_q4_0_does():
    """All 16 steps in use (amax / 7 steps would leave -8 unused): a group whose extreme is positive gets a negative
    scale; here every value is within half a step of its rounding."""
    weight = torch.tensor([[1.0, -0.5, 0.25, 0.0, 0.0, 0.125, -0.375, 1.0],
                           [-2.0, 1.0, 0.5, 0.0, 1.75, 0.0, 0.0, -0.25]])
    q = quantize(weight, Scheme(4, 4))
    assert q.q.tolist() == [[-8, 4, -2, 0, 0, -1, 3, -8], [-8, 4, 2, 0, -8, 0, 0, 1]]
    assert q.scales.tolist() == [[-0.125, -0.125], [0.25, -0.21875]]
    assert ((q.dequantize() - weight).abs() <= q.scales.abs().repeat_interleave(4, dim=1) / 2 + 1e-7).all()


def test_a_wrong_shape_is_refused(ops):
    weight = PackedInt(quantize(torch.randn(16, 64), Scheme(8, None)), ops)
    with pytest.raises(RuntimeError, match="packed weight has shape"):
        ops.linear_int(torch.randn(1, 32), weight.packed, weight.scales, None, 16, 8, 32, 16, None)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 70), half_k=st.integers(1, 150), group=st.sampled_from([None, 6, 32, 34, 128]),
       symmetric=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_on_bf16_rows_is_the_exact_product_rounded_to_bf16(ops, m, n, half_k, group, symmetric, with_bias, seed):
    """A bf16 model's int4 linears (AVX512-BF16 hosts: bf16 dot products on the rows as they are; elsewhere the
    float tile) give the exact product within float32 sums and one bf16 rounding, for any shape and grouping."""
    k = 2 * half_k
    generator = torch.Generator().manual_seed(seed)
    weight = quantize(torch.randn(n, k, generator=generator), Scheme(4, group))
    if not symmetric:
        weight = with_zero_points(weight, seed)
    x = torch.randn(m, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    out = PackedInt(weight, ops).linear(x, bias)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    exact = x.double() @ weight.dequantize().double().T + (0 if bias is None else bias.double())
    # the bf16 dot products sum x * (128 + q) and take 128 * sum(x) * scale off: terms up to (143 + |zero point|)
    # times the scale enter the float32 sums
    zero_points = 0 if weight.zero_points is None else weight.zero_points.double().abs().repeat_interleave(
        weight.group_size, dim=1)[:, :k]
    per_weight = (160 + zero_points) * weight.scales.double().abs().repeat_interleave(weight.group_size, dim=1)[:, :k]
    magnitude = x.double().abs() @ per_weight.T + (0 if bias is None else bias.double().abs())
    bound = exact.abs() * 2.0**-8 + magnitude * (k + 4) * 2.0**-23 + 1e-30
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}"
