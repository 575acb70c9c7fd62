"""Run every Triton kernel on CPU through the Triton interpreter, or compiled on the GPU when there is one.

With CUDA present (and ``TIDAL_KERNEL_TESTS=interpret`` not set) nothing below touches the
interpreter: the kernels compile for the GPU and every test's tensors are made there
(``torch.set_default_device("cuda")``), so the same tests check the compiled kernels.

``TRITON_INTERPRET=1`` only affects functions decorated with ``@triton.jit`` after it is set, and
that includes triton's own library (``tl.sum``, ``tl.max`` are jit functions decorated when
``import triton`` runs). It is set here, before any test module in this folder imports a kernel.
If something collected earlier already imported triton in compiled mode (importing
``transformers.models.llama`` does), triton's Python modules and ours are dropped from
``sys.modules`` so they are imported afresh in interpreter mode; triton's C extension cannot be
loaded twice and is kept (it holds no jit functions).
"""

from __future__ import annotations

import os
import sys

import pytest

import torch  # noqa: E402  (imports no triton)

ON_GPU = torch.cuda.is_available() and os.environ.get("TIDAL_KERNEL_TESTS") != "interpret"

if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="the kernel tests run Triton kernels (in the interpreter without a GPU)")


def _triton_is_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    import triton.language.standard

    return isinstance(triton.language.standard.sum, InterpretedFunction)


def _reimport_triton_in_interpreter_mode() -> None:
    stale = [
        name
        for name in sys.modules
        if (name == "triton" or name.startswith("triton.") or name.startswith("tidal.kernels."))
        and not name.startswith("triton._C")
    ]
    for name in stale:
        del sys.modules[name]


if not ON_GPU and not _triton_is_interpreted():
    _reimport_triton_in_interpreter_mode()
    assert _triton_is_interpreted()

# tolerances per dtype: fp32 differs from the reference only by summation order; bf16 by the
# rounding of probabilities / outputs to bf16 (8 mantissa bits; the interpreter also rounds
# fp32 -> bf16 toward zero, so up to one ulp = 2**-7 relative)
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


@pytest.fixture
def tolerances():
    return TOLERANCES


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _on_the_gpu():
    """Every tensor a test makes lives on the GPU when the kernels run compiled there."""
    if not ON_GPU:
        yield
        return
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)


class PagedKV:
    """Contiguous per-sequence K/V scattered into a paged cache through shuffled block tables."""

    def __init__(self, seq_lens, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3):
        self.seq_lens = list(seq_lens)
        self.block_size = block_size
        blocks_per_seq = [-(-n // block_size) for n in self.seq_lens]
        max_blocks = max(blocks_per_seq)
        num_blocks = sum(blocks_per_seq) + spare_blocks
        # garbage everywhere, so reading a slot the table does not name shows up as a wrong answer
        self.k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).mul(50).to(dtype)
        self.v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).mul(50).to(dtype)
        order = torch.randperm(num_blocks).tolist()
        self.block_tables = torch.zeros(len(self.seq_lens), max_blocks, dtype=torch.int32)
        self.keys, self.values = [], []
        for seq, (seq_len, n_blocks) in enumerate(zip(self.seq_lens, blocks_per_seq)):
            blocks = [order.pop() for _ in range(n_blocks)]
            self.block_tables[seq, :n_blocks] = torch.tensor(blocks, dtype=torch.int32)
            keys = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
            values = torch.randn(seq_len, num_kv_heads, head_dim).to(dtype)
            slots = self.slots(seq)
            self.k_cache.view(-1, num_kv_heads, head_dim)[slots] = keys
            self.v_cache.view(-1, num_kv_heads, head_dim)[slots] = values
            self.keys.append(keys)
            self.values.append(values)
        self.seq_lens_tensor = torch.tensor(self.seq_lens, dtype=torch.int32)

    def slots(self, seq: int) -> torch.Tensor:
        positions = torch.arange(self.seq_lens[seq])
        block_ids = self.block_tables[seq].long()[positions // self.block_size]
        return block_ids * self.block_size + positions % self.block_size


@pytest.fixture
def make_paged_kv():
    return PagedKV
