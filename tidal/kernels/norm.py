"""RMSNorm, optionally fused with the residual add that precedes it between decoder layers.

HF Llama semantics: ``s = x + residual`` is rounded to ``x.dtype`` (the residual stream is kept in
the model dtype), then ``out = s * rsqrt(mean(s^2) + eps) * weight`` in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # one program per row; the whole row (H <= a few thousand) fits one tile
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        # round the sum to the model dtype first, as HF's residual stream does
        summed = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden_size
    inv_rms = tl.math.rsqrt(mean_square + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = x * inv_rms * weight
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(norm(s) * weight, s)`` where ``s = x`` or ``x + residual``; x is ``[T, H]``.

    Without a residual, ``residual_out`` is ``x`` itself (no copy), since nothing writes to it.
    With one, ``s`` goes to ``residual_out`` when given (it may be ``residual`` itself: each row
    is read before it is written, so ``residual += x`` happens in place), else to a new tensor.
    """
    _check_layouts(x, weight, residual)
    num_rows, hidden_size = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is None:
        residual_out = x
    elif residual_out is None:
        residual_out = torch.empty_like(out)
    elif residual_out.shape != x.shape or residual_out.stride(1) != 1:
        raise ValueError(f"residual_out must match x {tuple(x.shape)}, got {tuple(residual_out.shape)}")
    if num_rows == 0:
        return out, residual_out
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,  # unused when HAS_RESIDUAL is False
        weight,
        out,
        residual_out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        residual_out.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_H=triton.next_power_of_2(hidden_size),
        num_warps=_num_warps(hidden_size),
    )
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of :func:`rms_norm`."""
    summed = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    s = summed.float()
    inv_rms = torch.rsqrt(s.pow(2).mean(dim=-1, keepdim=True) + eps)
    out = (s * inv_rms * weight.float()).to(x.dtype)
    return out, summed


def _num_warps(hidden_size: int) -> int:
    # enough threads that each holds a handful of elements of the row
    return max(1, min(16, triton.next_power_of_2(hidden_size) // 256))


def _check_layouts(x, weight, residual) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, H] with a contiguous last dimension, got {tuple(x.shape)}")
    if weight.shape != (x.shape[1],) or weight.stride(0) != 1:
        raise ValueError(f"weight must be [H]={x.shape[1]}, got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError(f"residual must match x {tuple(x.shape)}, got {tuple(residual.shape)}")
