"""The hand-written AVX512-BF16 linear (csrc/linear_bf16.cpp) computes F.linear: over odd and
ragged shapes, with and without bias, strided rows; and Linear uses it for decode-sized calls only,
on CPUs that have the instructions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from crowded_threads import alone_and_crowded
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.model import layers
from tidal.gpu.model.layers import Linear, gemv_ops, pack_gemv_weight


@pytest.fixture(scope="module")
def ops():
    loaded = gemv_ops(torch.bfloat16, "cpu")
    if loaded is None:
        pytest.skip("the bf16 linear kernel needs a CPU with avx512_bf16 and the C++ kernels built "
                    "(TIDAL_CPU_KERNELS=0 or no working compiler; see the logged warning)")
    return loaded


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """F.linear of the bf16 inputs in float64, and a bound on its float32 summation error."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    magnitude = F.linear(x.double().abs(), weight.double().abs())
    return exact, magnitude * x.shape[-1] * 2.0**-24


def assert_linear_matches(out: torch.Tensor, x, weight, bias) -> None:
    exact, summation = reference(x, weight, bias)
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    # one bf16 rounding of a float32 sum: half an ulp (2^-9 relative) plus the sum's own error
    error = (out.double() - exact).abs()
    bound = exact.abs() * 2.0**-8 + summation + 1e-30
    assert (error <= bound).all(), f"max error {error.max():.3g} at {(error - bound).argmax()}"


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 300), with_bias=st.booleans(),
       row_pad=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_kernel_matches_float_linear(ops, m, k, n, with_bias, row_pad, seed):
    gen = torch.Generator().manual_seed(seed)
    # rows row_pad elements apart beyond K: the kernel must follow x's row stride
    x = torch.randn(m, k + row_pad, generator=gen).bfloat16()[:, :k]
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    out = ops.linear_bf16(x, pack_gemv_weight(weight), n, bias)
    assert_linear_matches(out, x, weight, bias)


# the last two walk K in chunks (more than 4 rows and K beyond 2048)
@pytest.mark.parametrize("m,n,k", [(1, 8192, 768), (16, 4096, 768), (3, 768, 2048), (1, 17, 4097), (9, 70, 4099),
                                   (40, 64, 2050)])
def test_kernel_at_model_shapes(ops, m, n, k):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=gen).bfloat16()
    weight = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    assert_linear_matches(ops.linear_bf16(x, pack_gemv_weight(weight), n, None), x, weight, None)


@pytest.mark.parametrize("m,n,k", [(1, 8192, 768), (16, 4096, 768), (5, 768, 2048)])
def test_threads_that_take_over_work_give_the_one_thread_result(ops, m, n, k):
    # csrc/claims.h: with four times more threads than cores, threads are preempted mid-call and the others
    # take over the rest of their shares; every column group still runs exactly once, with the same sums
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=gen).bfloat16()
    packed = pack_gemv_weight((torch.randn(n, k, generator=gen) / k**0.5).bfloat16())
    alone, crowded = alone_and_crowded(lambda: ops.linear_bf16(x, packed, n, None))
    assert all(torch.equal(out, alone) for out in crowded)


def test_kernel_keeps_leading_dims_and_empty_batches(ops):
    weight = torch.randn(24, 10).bfloat16()
    packed = pack_gemv_weight(weight)
    x = torch.randn(2, 3, 10).bfloat16()
    assert_linear_matches(ops.linear_bf16(x, packed, 24, None), x, weight, None)
    assert ops.linear_bf16(torch.empty(0, 10, dtype=torch.bfloat16), packed, 24, None).shape == (0, 24)
    with pytest.raises(RuntimeError, match="packed weight has shape"):
        ops.linear_bf16(torch.randn(1, 12).bfloat16(), packed, 24, None)


def packed_linear_module(n: int, k: int, bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    linear = Linear(k, n, bias, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    weight = linear.weight.detach().clone()
    linear.pack()
    return linear, weight, linear.bias


@pytest.mark.parametrize("bias", [False, True])
def test_linear_runs_the_kernel_for_every_call_without_amx(ops, monkeypatch, bias):
    from tidal.gpu.cpu import features

    monkeypatch.setattr(features, "cpu_native_bf16", lambda: "avx512_bf16")
    linear, weight, b = packed_linear_module(50, 33, bias)
    assert linear.gemv_packed is not None and linear.packed is None and linear.weight is None  # one copy
    for rows in (1, 16, 17, 300):
        x = torch.randn(rows, 33).bfloat16()
        assert_linear_matches(linear(x), x, weight, b)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_with_amx_runs_the_kernel_for_decode_rows_and_onednn_above(ops, monkeypatch, bias):
    from tidal.gpu.cpu import features

    monkeypatch.setattr(features, "cpu_native_bf16", lambda: "amx_bf16")
    linear, weight, b = packed_linear_module(50, 33, bias)
    assert linear.gemv_packed is not None and linear.packed is not None and linear.weight is None
    calls = []

    class Spy:  # counts the kernel's calls
        def linear_bf16(self, *args):
            calls.append(1)
            return ops.linear_bf16(*args)

    monkeypatch.setattr(linear, "_gemv", Spy())
    for rows in (1, layers.AMX_GEMV_MAX_ROWS, layers.AMX_GEMV_MAX_ROWS + 1, 100):
        x = torch.randn(rows, 33).bfloat16()
        assert_linear_matches(linear(x), x, weight, b)
    assert len(calls) == 2  # the two calls of at most AMX_GEMV_MAX_ROWS rows


@pytest.mark.parametrize("why", ["no avx512_bf16", "TIDAL_CPU_GEMV=0"])
def test_linear_keeps_only_onednn_where_the_kernel_is_off(monkeypatch, why):
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("this torch's oneDNN has no bf16")
    from tidal.gpu.cpu import features

    if why == "no avx512_bf16":
        monkeypatch.setattr(features, "cpu_native_bf16", lambda: None)
    else:
        monkeypatch.setattr(layers, "USE_GEMV", False)
    linear, weight, _ = packed_linear_module(40, 24, False)
    assert linear.gemv_packed is None and linear.packed is not None
    x = torch.randn(2, 24).bfloat16()
    assert_linear_matches(linear(x), x, weight, None)
