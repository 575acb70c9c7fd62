"""The int8/int4 linear with int8 activations (csrc/linear_int_a8.cpp, --quantization w8a8 / w4a8): x is rounded
to int8 in blocks of 32 inputs (scale max|x| / 127) and the result is that rounded x times the dequantized weight,
exactly up to float32 rounding of the per-block partial sums; ragged N and K (a partial last block), groups,
zero points, 1 to 40 rows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from quantized_checkpoints import with_zero_points
from tidal.gpu.cpu import kernels
from tidal.gpu.model.quantization import PackedInt, Scheme, int_linear_ops, quantize


@pytest.fixture(scope="module")
def ops():
    loaded = int_linear_ops("cpu")
    if loaded is None:
        pytest.skip("the int linear kernel needs a CPU with AVX2+FMA and the C++ kernels built")
    return loaded


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    return _rounded(F.pad(x, (0, -k % 32)))[..., :k]


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel sees it (float64): int8 blocks of 32, q = round-half-even(x * (127 / max|x|)) and scale
    max|x| / 127, both factors in float32 as the kernel computes them (so the same ties round the same way; a
    tensor / tensor division: torch computes a number / tensor as a product with the reciprocal)."""
    blocks = x.float().view(*x.shape[:-1], -1, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(top > 0, torch.full_like(top, 127) / torch.where(top > 0, top, 1), 0)
    q = torch.round(blocks * inverse)
    return (q.double() * (top / 127).double()).view_as(x)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 90), half_k=st.integers(1, 384), bits=st.sampled_from([8, 4]),
       group=st.sampled_from([None, 32, 64, 128]), symmetric=st.booleans(), with_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_rounded_activations_times_the_dequantized_weight(ops, m, n, half_k, bits, group, symmetric,
                                                                    with_bias, seed):
    k = 2 * half_k  # any even K: the last block of 32 and the last group may be partial
    generator = torch.Generator().manual_seed(seed)
    weight = quantize(torch.randn(n, k, generator=generator), Scheme(bits, group, activation_bits=8))
    if not symmetric:
        weight = with_zero_points(weight, seed)
    x = torch.randn(m, k, generator=generator) * torch.rand(m, 1, generator=generator) * 4
    bias = torch.randn(n, generator=generator) if with_bias else None
    out = PackedInt(weight, ops).linear(x, bias)
    assert out.shape == (m, n) and out.dtype == torch.float32
    dense = weight.dequantize().double()
    x_rounded = rounded_activations(x)
    exact = x_rounded @ dense.T + (0 if bias is None else bias.double())
    magnitude = x_rounded.abs() @ dense.abs().T + (0 if bias is None else bias.double().abs())
    # float32 rounding of each 32-block's scaled sum, the offset term and the running total (int sums are exact)
    error = (out.double() - exact).abs()
    bound = magnitude * (k // 32 + 8) * 2.0**-22 + 1e-6 * magnitude.max()
    assert (error <= bound).all(), f"max error {error.max():.3g}"
    # and the rounding of x costs at most half a step of each block, times the weights
    step = F.pad(x.double(), (0, -k % 32)).view(m, -1, 32).abs().amax(dim=-1).repeat_interleave(32, dim=1)[:, :k] / 127
    drift = (out.double() - (x.double() @ dense.T + (0 if bias is None else bias.double()))).abs()
    assert (drift <= (step / 2) @ dense.abs().T + bound).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_bf16_activations_give_a_bf16_result(ops, bits):
    weight = quantize(torch.randn(48, 256), Scheme(bits, 128 if bits == 4 else None, activation_bits=8))
    x = torch.randn(2, 3, 256).bfloat16()
    bias = torch.randn(48).bfloat16()
    out = PackedInt(weight, ops).linear(x, bias)
    assert out.shape == (2, 3, 48) and out.dtype == torch.bfloat16
    reference = rounded_activations(x.float()).float() @ weight.dequantize().T + bias.float()
    assert torch.allclose(out.float(), reference, atol=0.1, rtol=0.02)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 70), half_k=st.integers(1, 200), bits=st.sampled_from([8, 4]),
       with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_bf16_rows_give_the_float_rows_result_rounded_to_bf16(ops, m, n, half_k, bits, with_bias, seed):
    """A bf16 model's rows are read and its output rounded inside the kernel (no float copies): bit for bit what
    widening the rows, running them in float32 and rounding the result (torch's round to nearest even) gives,
    whole column blocks and a partial last one alike."""
    k = 2 * half_k
    generator = torch.Generator().manual_seed(seed)
    packed = PackedInt(quantize(torch.randn(n, k, generator=generator), Scheme(bits, 32, activation_bits=8)), ops)
    x = (torch.randn(m, k, generator=generator) * 3).bfloat16()
    bias = torch.randn(n, generator=generator).bfloat16() if with_bias else None
    out = packed.linear(x, bias)
    expected = packed.linear(x.float(), None if bias is None else bias.float()).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), expected.view(torch.int16))


def test_zero_rows_give_zero_not_nan(ops):
    weight = PackedInt(quantize(torch.randn(16, 64), Scheme(4, 32, activation_bits=8)), ops)
    out = weight.linear(torch.zeros(3, 64), None)
    assert torch.equal(out, torch.zeros(3, 16))


def test_a_group_off_the_32_grid_is_refused_at_packing(ops):
    with pytest.raises(ValueError, match="multiple of 32"):
        PackedInt(quantize(torch.randn(16, 96), Scheme(4, 48, activation_bits=8)), ops)


def test_a_wrong_layout_is_refused_by_the_kernel(ops):
    float_layout = PackedInt(quantize(torch.randn(16, 64), Scheme(8, None)), ops)
    with pytest.raises(RuntimeError, match="packed weight has shape"):
        ops.linear_int(torch.randn(1, 64), float_layout.packed, float_layout.scales, None, 16, 8, 64, 8, None)


def tile_outputs(ops) -> list[torch.Tensor]:
    """The kernel's results over every tile shape (one row: four column blocks and one; 2-5 rows: four rows and
    the rest), int8 and int4, per channel and grouped, with and without zero points, ragged N and K."""
    outputs = []
    for case, (m, n, k, bits, group, zero_points) in enumerate([
            (1, 8 * 9 + 3, 200, 8, None, False), (1, 8 * 9 + 3, 256, 4, 128, False), (1, 40, 96, 4, 32, True),
            (5, 8 * 5 + 1, 160, 8, 32, True), (3, 24, 288, 4, 128, False), (2, 16, 64, 8, None, False)]):
        generator = torch.Generator().manual_seed(case)
        weight = quantize(torch.randn(n, k, generator=generator), Scheme(bits, group, activation_bits=8))
        if zero_points:
            weight = with_zero_points(weight, case)
        x = torch.randn(m, k, generator=generator) * 3
        outputs.append(PackedInt(weight, ops).linear(x, torch.randn(n, generator=generator)))
    return outputs


def test_the_avx2_build_computes_what_this_cpus_build_computes(ops, tmp_path):
    """A CPU with AVX512-VNNI multiplies the bytes with vpdpbusd, one without with vpmaddubsw + vpmaddwd: both sum
    the same integers exactly, so the results are the same floats. TIDAL_CPU_ISA=avx2 builds and runs the library
    as an AVX2-only CPU does (no AVX-512 flags, no bf16 kernel, no native bf16), so a suite on an AVX-512 host
    compiles and checks that build too."""
    if not kernels._compile_flags()[0].startswith("avx512"):
        pytest.skip("this CPU's own build is the AVX2 one (or none), which the tests above check")
    here = os.path.dirname(__file__)
    script = (f"import sys, torch; sys.path[:0] = [{here!r}, {os.path.dirname(os.path.dirname(here))!r}]\n"
              "import test_linear_int_a8 as t\n"
              "from tidal.gpu.model.quantization import int_linear_ops\n"
              "from tidal.gpu.cpu import features, kernels\n"
              "ops = int_linear_ops('cpu'); assert ops.linear_int_a8_isa() == 'avx2', ops.linear_int_a8_isa()\n"
              "assert kernels._library()[0].startswith('tidal_cpu_avx2_'), kernels._library()\n"
              "assert features.cpu_native_bf16() is None and not ops.linear_bf16_supported()\n"
              f"torch.save(t.tile_outputs(ops), {str(tmp_path / 'avx2.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "TIDAL_CPU_ISA": "avx2"})
    avx2 = torch.load(tmp_path / "avx2.pt")
    vnni = tile_outputs(ops)
    assert len(avx2) == len(vnni)
    for forced, native in zip(avx2, vnni, strict=True):
        assert torch.equal(forced, native)
