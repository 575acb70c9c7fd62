from __future__ import annotations

import pytest
import torch

from tidal.kernels.linear_int import linear_int, linear_int_reference, pack_int_weight


def random_int_weight(n, k, bits, group_size, zero_points):
    """Integers over their whole range, positive scales, and zero points anywhere in the range."""
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
    groups = -(-k // group_size)
    q = torch.randint(low, high, (n, k), dtype=torch.int8)
    scales = torch.rand(n, groups) * 0.02 + 0.001
    zp = torch.randint(low, high, (n, groups), dtype=torch.int8) if zero_points else None
    return q, scales, zp


def dequantized(q, scales, zp, group_size):
    """What ``QuantizedWeight.dequantize`` computes: (q - zp) * scale, each group its own, in fp32."""
    k = q.shape[1]
    w = q.float()
    if zp is not None:
        w = w - zp.float().repeat_interleave(group_size, dim=1)[:, :k]
    return w * scales.repeat_interleave(group_size, dim=1)[:, :k]


# (N, K, group size): per channel (group = K), groups that fill a tile, a smaller group that sets the tile,
# an odd group (dequantized weight by weight) and odd N / K everywhere a layout allows them
SHAPES_INT8 = [(37, 53, 53), (40, 256, 128), (33, 96, 32), (19, 70, 7)]
SHAPES_INT4 = [(37, 54, 54), (40, 256, 128), (33, 192, 64), (19, 61, 10)]


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("bits, n, k, group_size", [(8, *s) for s in SHAPES_INT8] + [(4, *s) for s in SHAPES_INT4])
@pytest.mark.parametrize("zero_points", [False, True])
def test_matches_the_dequantized_weight_in_fp32(m, bits, n, k, group_size, zero_points):
    q, scales, zp = random_int_weight(n, k, bits, group_size, zero_points)
    x = torch.randn(m, k)
    bias = torch.randn(n)
    weight = pack_int_weight(q, scales, zp, bits, group_size)

    out = linear_int(x, weight, bias)

    expected = x @ dequantized(q, scales, zp, group_size).T + bias
    assert out.shape == (m, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(linear_int_reference(x, q, scales, zp, group_size, bias), expected,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, n, k, group_size", [(8, 37, 53, 53), (4, 40, 256, 128), (4, 19, 61, 10)])
def test_half_precision_activations_accumulate_in_fp32(dtype, bits, n, k, group_size):
    q, scales, zp = random_int_weight(n, k, bits, group_size, zero_points=True)
    x = torch.randn(17, k).to(dtype)
    weight = pack_int_weight(q, scales, zp, bits, group_size)

    out = linear_int(x, weight)

    # the reference multiplies the same rounded activations in fp32; the kernel may round the weight (odd
    # groups) and the output once to the activation dtype
    expected = x.float() @ dequantized(q, scales, zp, group_size).T
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)


def test_leading_dimensions_and_a_strided_input_are_rows():
    q, scales, _ = random_int_weight(24, 64, 8, 64, False)
    weight = pack_int_weight(q, scales, None, 8, 64)
    x = torch.randn(2, 3, 128)[..., ::2]  # last dim strided
    out = linear_int(x, weight)
    assert out.shape == (2, 3, 24)
    torch.testing.assert_close(out, x @ dequantized(q, scales, None, 64).T, atol=1e-4, rtol=1e-4)


def test_int4_packs_two_values_a_byte():
    q, scales, _ = random_int_weight(32, 256, 4, 128, False)
    int4, int8 = pack_int_weight(q, scales, None, 4, 128), pack_int_weight(q, scales, None, 8, 128)
    assert int4.packed.dtype == torch.uint8 and int4.packed.numel() * 2 == int8.packed.numel() == 32 * 256


def test_mismatched_scales_are_refused():
    q, scales, _ = random_int_weight(8, 64, 8, 32, False)
    with pytest.raises(ValueError, match=r"\[N, groups\] = \(8, 2\)"):
        pack_int_weight(q, scales[:, :1], None, 8, 32)
    x = torch.randn(1, 63)
    with pytest.raises(ValueError, match="63 inputs"):
        linear_int(x, pack_int_weight(q, scales, None, 8, 32))
