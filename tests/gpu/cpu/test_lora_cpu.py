"""The CPU LoRA kernel (csrc/lora.cpp) adds each row's own slot's B (A x) to a linear's output: against a float64
torch reference on rows of several adapters and of none (left exactly as they were), ranks below the bound, fused
outputs of one, two and three parts, K and N off the vector widths, parts of several 64-column tiles and a tail,
a slot with more rows than one task takes, float32 and bf16. B is packed as LoraSlots packs it (pack_lora_b). Every
weight the layout says a slot does not own (rows past its rank, B columns of another part, the padding of a part's
last packed block) holds garbage: the kernel must not read it.
The AVX2 build (TIDAL_CPU_ISA=avx2: no AVX512-BF16 dot products) is checked against the same reference."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tidal.gpu.cpu import kernels
from tidal.gpu.model.lora import pack_lora_b

CASES = [  # (rows' slots, ranks of the slots, part sizes, K, max rank)
    ([0, -1, 2, 2, 1, -1, 0, 2, 2, 2], [16, 3, 7], (64, 24, 24), 64, 16),  # a fused qkv, ranks below the bound
    ([1], [4, 8], (96,), 100, 8),  # one row, K off every vector width
    ([-1, -1], [8], (40, 40), 48, 8),  # no adapter row: nothing changes
    ([0, 1, 0, 1, 3, 3, 3, 3, 3, -1, 0], [2, 16, 16, 5], (33, 31), 57, 16),  # N off the widths, a tile tail of rows
    ([0] * 18 + [1, -1, 1], [5, 16], (80, 200), 72, 16),  # 18 rows of one slot (two tasks); 5 and 13 blocks
    ([t % 4 for t in range(15)] + [-1], [16, 16, 8, 16], (576, 576), 576, 16),  # enough work for every thread
]


@pytest.fixture(scope="module")
def ops():
    loaded = kernels.load_cpu_ops()
    if loaded is None:
        pytest.skip("the C++ CPU kernels are not built here")
    return loaded


def case_tensors(case: int, dtype: torch.dtype):
    slots, ranks, part_sizes, k, max_rank = CASES[case]
    generator = torch.Generator().manual_seed(case)
    parts, n = len(part_sizes), sum(part_sizes)
    width = parts * max_rank
    a = torch.randn(len(ranks) * width, k, generator=generator).to(dtype)
    b = torch.randn(len(ranks) * width, n, generator=generator).mul(0.1).to(dtype)
    x = torch.randn(len(slots), k, generator=generator).to(dtype)
    out = torch.randn(len(slots), n, generator=generator).to(dtype)
    return (out, x, a, b, torch.tensor(slots, dtype=torch.int32), torch.tensor(ranks, dtype=torch.int32),
            list(part_sizes), max_rank)


def packed(b: torch.Tensor, part_sizes: list[int], max_rank: int) -> torch.Tensor:
    """``b`` packed for the kernel, the padding past each part's columns garbage."""
    own = pack_lora_b(torch.ones_like(b), tuple(part_sizes), max_rank)
    return torch.where(own == 1, pack_lora_b(b, tuple(part_sizes), max_rank), torch.full_like(own, 1e4))


def lora_add(ops, out, x, a, b, slots, ranks, part_sizes, max_rank) -> torch.Tensor:
    return ops.lora_add_(out, x, a, packed(b, part_sizes, max_rank), slots, ranks, part_sizes, max_rank)


def reference(out, x, a, b, slots, ranks, part_sizes, max_rank) -> torch.Tensor:
    """float64 out + B (A x) over only what each slot owns: its first ranks[s] rows of each part, that part's columns."""
    exact = out.double().clone()
    width = len(part_sizes) * max_rank
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        column = 0
        for p, size in enumerate(part_sizes):
            first = s * width + p * max_rank
            rows = slice(first, first + int(ranks[s]))
            h = a[rows].double() @ x[t].double()
            exact[t, column:column + size] += h @ b[rows, column:column + size].double()
            column += size
    return exact


def check(got: torch.Tensor, out: torch.Tensor, exact: torch.Tensor, slots: torch.Tensor) -> None:
    base = slots < 0
    assert torch.equal(got[base], out[base]), "a base-model row is left exactly as it was"
    # float32 sums of the exact products; a bf16 output is rounded once at the end
    bound = 1e-4 * (1 + exact.abs()) if got.dtype == torch.float32 else 2.0**-8 * exact.abs() + 1e-3
    error = (got.double() - exact).abs()
    assert (error <= bound).all(), f"max error {error.max():.3g}"


def outputs(ops) -> list[torch.Tensor]:
    """The kernel's result of every case and dtype (for the AVX2 build's run in a child process)."""
    results = []
    for case in range(len(CASES)):
        for dtype in (torch.float32, torch.bfloat16):
            tensors = case_tensors(case, dtype)
            results.append(lora_add(ops, tensors[0].clone(), *tensors[1:]))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_row_adds_its_own_slots_product(ops, case, dtype):
    out, *rest = case_tensors(case, dtype)
    got = lora_add(ops, out.clone(), *rest)
    check(got, out, reference(out, *rest), rest[3])


def test_a_slot_out_of_range_is_refused_before_any_write(ops):
    out, x, a, b, slots, ranks, part_sizes, max_rank = case_tensors(0, torch.float32)
    slots[3] = len(ranks)
    before = out.clone()
    with pytest.raises(RuntimeError, match="row 3's LoRA slot 3 is not -1 or below 3"):
        lora_add(ops, out, x, a, b, slots, ranks, part_sizes, max_rank)
    assert torch.equal(out, before)


def test_the_avx2_build_matches_the_reference_too(ops, tmp_path):
    """TIDAL_CPU_ISA=avx2 builds and runs the library as a CPU without AVX-512 does: the shrink on eight-float
    vectors instead of vdpbf16ps. Its results must meet the same reference."""
    if not kernels._compile_flags()[0].startswith("avx512"):
        pytest.skip("this CPU's own build is the AVX2 one (or none), which the tests above check")
    here = os.path.dirname(__file__)
    script = (f"import sys, torch; sys.path[:0] = [{here!r}, {os.path.dirname(os.path.dirname(here))!r}]\n"
              "import test_lora_cpu as t\n"
              "from tidal.gpu.cpu import kernels\n"
              "assert kernels._library()[0].startswith('tidal_cpu_avx2_'), kernels._library()\n"
              f"torch.save(t.outputs(kernels.load_cpu_ops()), {str(tmp_path / 'avx2.pt')!r})\n")
    subprocess.run([sys.executable, "-c", script], check=True, env={**os.environ, "TIDAL_CPU_ISA": "avx2"})
    results = iter(torch.load(tmp_path / "avx2.pt"))
    for case in range(len(CASES)):
        for dtype in (torch.float32, torch.bfloat16):
            out, *rest = case_tensors(case, dtype)
            check(next(results), out, reference(out, *rest), rest[3])
