"""The AVX2 linear on bf16-stored weights (csrc/linear_avx2.cpp) computes F.linear of float32 activations
with the weights' bf16 values: over odd and ragged shapes, with and without bias, strided rows, decode and
prefill row counts; and Linear packs a float32 weight for it only when asked to store it in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from crowded_threads import alone_and_crowded
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.model.layers import Linear, avx2_linear_ops, pack_avx2_weight


@pytest.fixture(scope="module")
def ops():
    loaded = avx2_linear_ops("cpu")
    if loaded is None:
        pytest.skip("the AVX2 linear kernel needs a CPU with AVX2+FMA and the C++ kernels built "
                    "(TIDAL_CPU_GEMV=0 or no working compiler; see the logged warning)")
    return loaded


def assert_linear_matches(out: torch.Tensor, x, weight_bf16, bias) -> None:
    """Within float32 summation error of F.linear in float64 over the bf16 weight's exact values."""
    exact = F.linear(x.double(), weight_bf16.double(), None if bias is None else bias.double())
    assert out.dtype == torch.float32 and out.shape == exact.shape
    magnitude = F.linear(x.double().abs(), weight_bf16.double().abs())
    if bias is not None:
        magnitude = magnitude + bias.double().abs()
    bound = magnitude * (x.shape[-1] + 2) * 2.0**-24 + 1e-30
    error = (out.double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g} at {(error - bound).argmax()}"


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 64), k=st.integers(1, 300), n=st.integers(1, 300), with_bias=st.booleans(),
       row_pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_kernel_matches_float_linear(ops, m, k, n, with_bias, row_pad, seed):
    gen = torch.Generator().manual_seed(seed)
    # rows row_pad elements apart beyond K: the kernel must follow x's row stride
    x = torch.randn(m, k + row_pad, generator=gen)[:, :k]
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen) if with_bias else None
    out = ops.linear_avx2(x, pack_avx2_weight(weight), n, bias)
    assert_linear_matches(out, x, weight, bias)


# every row count 1-16 at a model shape (each tile kind and remainder), and K beyond 2048 with more than
# 6 rows (K walked in chunks, the sums carried between them)
@pytest.mark.parametrize("m,n,k", [*((m, 1280, 768) for m in range(1, 17)), (1, 8192, 768), (7, 17, 4097),
                                   (13, 70, 4099), (64, 64, 2050), (3, 768, 2048)])
def test_kernel_at_model_shapes(ops, m, n, k):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(n, generator=gen)
    assert_linear_matches(ops.linear_avx2(x, pack_avx2_weight(weight), n, bias), x, weight, bias)


def test_kernel_keeps_leading_dims_and_empty_batches(ops):
    weight = torch.randn(24, 10).bfloat16()
    packed = pack_avx2_weight(weight)
    x = torch.randn(2, 3, 10)
    assert_linear_matches(ops.linear_avx2(x, packed, 24, None), x, weight, None)
    assert ops.linear_avx2(torch.empty(0, 10), packed, 24, None).shape == (0, 24)
    with pytest.raises(RuntimeError, match="packed weight has shape"):
        ops.linear_avx2(torch.randn(1, 12), packed, 24, None)
    with pytest.raises(RuntimeError, match="float32"):
        ops.linear_avx2(torch.randn(1, 10).bfloat16(), packed, 24, None)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_stores_a_float32_weight_in_bf16_only_when_asked(ops, bias):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 33, generator=gen).bfloat16().float()  # bf16 values, as from a bf16 checkpoint
    b = torch.randn(50, generator=gen) if bias else None

    def linear(weight_dtype):
        module = Linear(33, 50, bias, torch.float32, "cpu")
        with torch.no_grad():
            module.weight.copy_(weight)
            if bias:
                module.bias.copy_(b)
        module.pack(weight_dtype)
        return module

    plain, stored = linear(None), linear(torch.bfloat16)
    assert plain.avx2_packed is None and plain.weight is not None  # float32 stays float32
    assert stored.weight is None and stored.avx2_packed.dtype == torch.bfloat16  # one bf16 copy
    for rows in (1, 4, 16, 300):
        x = torch.randn(rows, 33, generator=gen)
        assert_linear_matches(stored(x), x, weight, b)
        # lossless on bf16 values: the float32 linear's result up to summation order
        torch.testing.assert_close(stored(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(1, 8192, 768), (16, 4096, 768), (9, 768, 2048)])
def test_threads_that_take_over_work_give_the_one_thread_result(ops, m, n, k):
    # csrc/claims.h: with four times more threads than cores, threads are preempted mid-call and the others
    # take over the rest of their shares; every column group still runs exactly once, with the same sums
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen)
    packed = pack_avx2_weight((torch.randn(n, k, generator=gen) / k**0.5).bfloat16())
    alone, crowded = alone_and_crowded(lambda: ops.linear_avx2(x, packed, n, None))
    assert all(torch.equal(out, alone) for out in crowded)
