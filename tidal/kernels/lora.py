"""Each row's own LoRA product added to a Linear's output: ``out[t] += B[s] (A[s] x[t])`` for the row's slot s.

The layout is tidal's LoRA slots (tidal/gpu/model/lora.py): ``a`` [slots * width, K] and ``b`` [slots * width,
N] hold every slot's adapter side by side, ``width`` rows each; ``slots`` [T] int32 names each row's slot, -1
for a base-model row (nothing added). Two kernels, as punica's shrink and expand: the first reduces x over K
into ``h`` [T, width] with the row's slot's A, the second adds ``h`` times the slot's B to ``out``. Each row
reads only its own slot's weights, whatever the mix of adapters in the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, h_ptr, stride_x, stride_a, stride_h, K, WIDTH,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    w_mask = w < WIDTH
    a_rows = slot.to(tl.int64) * WIDTH + w
    acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + row * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + k[None, :], mask=w_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + row * stride_h + w, acc, mask=w_mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slots_ptr, out_ptr, stride_h, stride_b, stride_out, N, WIDTH,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for w0 in range(0, WIDTH, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        w_mask = w < WIDTH
        h = tl.load(h_ptr + row * stride_h + w, mask=w_mask, other=0.0)
        b_rows = slot.to(tl.int64) * WIDTH + w
        b = tl.load(b_ptr + b_rows[:, None] * stride_b + n[None, :], mask=w_mask[:, None] & n_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(h[:, None] * b, axis=0)
    out = tl.load(out_ptr + row * stride_out + n, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + n, (out + acc).to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
             width: int) -> torch.Tensor:
    """``out`` [T, N] plus each row's slot's ``B (A x)``, in place; returns ``out``. ``x`` [T, K] and ``out`` have
    unit stride along their last dimension; ``slots`` [T] int32, -1 for a row with no adapter."""
    _check(out, x, a, b, slots, width)
    num_rows, k = x.shape
    n = out.shape[1]
    if num_rows == 0:
        return out
    h = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    block_w = triton.next_power_of_2(min(width, 64))
    _shrink_kernel[(num_rows, triton.cdiv(width, block_w))](
        x, a, slots, h, x.stride(0), a.stride(0), h.stride(0), k, width, BLOCK_W=block_w, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(num_rows, triton.cdiv(n, block_n))](
        h, b, slots, out, h.stride(0), b.stride(0), out.stride(0), n, width, BLOCK_N=block_n,
        BLOCK_W=triton.next_power_of_2(min(width, 32)))
    return out


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                       width: int) -> torch.Tensor:
    """``lora_add`` in plain torch, one row at a time (float32 sums, rounded once into ``out``)."""
    _check(out, x, a, b, slots, width)
    for row, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        rows = slice(slot * width, (slot + 1) * width)
        h = a[rows].float() @ x[row].float()
        out[row] = (out[row].float() + h @ b[rows].float()).to(out.dtype)
    return out


def _check(out, x, a, b, slots, width) -> None:
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0] or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and out {tuple(out.shape)} must be [T, K] and [T, N], unit stride")
    if a.shape[1] != x.shape[1] or b.shape[1] != out.shape[1] or a.shape[0] != b.shape[0] or a.shape[0] % width:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} do not fit x {tuple(x.shape)}, "
                         f"out {tuple(out.shape)} and slots of {width} rows")
    if slots.shape != (x.shape[0],) or slots.dtype != torch.int32:
        raise ValueError(f"slots must be [T] int32, got {tuple(slots.shape)} {slots.dtype}")
