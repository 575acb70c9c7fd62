"""Weight-only int8/int4 linear: ``y = x @ dequant(W).T (+ bias)``, dequantized in registers.

``W`` [N, K] is integers ``q`` with float32 scales per output channel or per group of ``group_size``
inputs and optional zero points: ``w = (q - zero_point) * scale``. Decode at small batch is bound by
reading the weights, so the layout is chosen for the loads: ``pack_int_weight`` cuts the weight into
tiles of ``BLOCK_N`` outputs x ``block_k`` inputs and stores each tile as one contiguous run of bytes
(``[N tiles, K tiles, BLOCK_N, block_k / values per byte]``), so a program's load of a tile is one
coalesced stream with no masks (N and K are padded with zeros). int4 holds two values per byte, unsigned
(q + 8): the low nibble of byte j is input j of the tile, the high nibble input j + block_k / 2, so each
half meets a contiguous slice of ``x``. Scales and zero points are ``[groups, N]`` (outputs contiguous).

When a tile lies inside one scale group (``group_size`` a multiple of ``block_k``, or one scale per
channel), ``q - zero_point`` goes to the tensor cores as small exact integers and the scale multiplies
the fp32 partial sum; otherwise each weight is dequantized with its own scale before the dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

BLOCK_N = 32  # outputs per tile: 32 x 128 int8 = 4 KiB per load, and N / 32 programs for a decode GEMV
BLOCK_K = 128  # inputs per tile unless a smaller scale group sets it


@dataclass
class IntWeight:
    """A weight in this kernel's layout (see the module docstring); ``n``, ``k``: the unpadded shape."""

    packed: torch.Tensor  # int8 [N tiles, K tiles, BLOCK_N, block_k] or uint8 [..., block_k / 2]
    scales: torch.Tensor  # float32 [groups, N padded]
    zero_points: torch.Tensor | None  # float32 [groups, N padded]
    n: int
    k: int
    bits: int
    group_size: int
    block_k: int

    @property
    def scale_per_tile(self) -> bool:
        return self.group_size >= self.k or self.group_size % self.block_k == 0

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: the integers, scales and zero points."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.zero_points) if t is not None)


def _block_k(bits: int, group_size: int, k: int) -> int:
    if group_size >= k or group_size % BLOCK_K == 0:
        return BLOCK_K
    smallest = 32 if bits == 4 else 16  # a dot needs 16 inputs per half
    for size in (64, 32, 16):
        if size >= smallest and group_size % size == 0:
            return size
    return BLOCK_K  # an odd group: dequantized weight by weight


def pack_int_weight(q: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None, bits: int,
                    group_size: int) -> IntWeight:
    """``q`` int8 [N, K] (values in [-2^(bits-1), 2^(bits-1) - 1]), ``scales`` [N, groups], ``zero_points``
    [N, groups] or None -> an ``IntWeight`` on q's device."""
    if bits not in (4, 8):
        raise ValueError(f"linear_int runs int8 and int4 weights, not int{bits}")
    n, k = q.shape
    groups = -(-k // group_size)
    if scales.shape != (n, groups) or (zero_points is not None and zero_points.shape != (n, groups)):
        raise ValueError(f"scales/zero points must be [N, groups] = {(n, groups)} for a weight of {(n, k)}, got "
                         f"{tuple(scales.shape)}{'' if zero_points is None else ' / ' + str(tuple(zero_points.shape))}")
    block_k = _block_k(bits, group_size, k)
    n_pad, k_pad = -n % BLOCK_N, -k % block_k
    tiles = F.pad(q, (0, k_pad, 0, n_pad)).view((n + n_pad) // BLOCK_N, BLOCK_N, (k + k_pad) // block_k, block_k)
    tiles = tiles.transpose(1, 2)  # [N tiles, K tiles, BLOCK_N, block_k]
    if bits == 8:
        packed = tiles.contiguous()
    else:
        unsigned = (tiles.to(torch.int16) + 8).to(torch.uint8)
        half = block_k // 2
        packed = (unsigned[..., :half] | (unsigned[..., half:] << 4)).contiguous()

    def per_output(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t.float(), (0, 0, 0, n_pad)).T.contiguous()

    return IntWeight(packed, per_output(scales), None if zero_points is None else per_output(zero_points),
                     n, k, bits, group_size, block_k)


@triton.jit
def _accumulate(acc, x_ptr, stride_xm, rows, row_mask, k_start, q, offsets, K, n_padded, cols, scale_ptr,
                zero_ptr, group_size, HAS_ZERO: tl.constexpr, SCALE_PER_TILE: tl.constexpr,
                DOT_IN_FP32: tl.constexpr):
    """acc += x[rows, k_start + offsets] @ dequant(q).T, for q [BLOCK_N, len(offsets)] (already signed)."""
    ks = k_start + offsets
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_mask[:, None] & (ks[None, :] < K),
                other=0.0)
    w = q.to(tl.float32)
    if SCALE_PER_TILE:
        group = k_start // group_size
        if HAS_ZERO:
            w -= tl.load(zero_ptr + group * n_padded + cols)[:, None]
        scale = tl.load(scale_ptr + group * n_padded + cols)
        if DOT_IN_FP32:
            part = tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))  # small integers: exact in fp16/bf16
        return acc + part * scale[None, :]
    groups = ks // group_size
    inside = (ks < K)[None, :]
    where = groups[None, :] * n_padded + cols[:, None]
    if HAS_ZERO:
        w -= tl.load(zero_ptr + where, mask=inside, other=0.0)
    w *= tl.load(scale_ptr + where, mask=inside, other=0.0)
    if DOT_IN_FP32:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _linear_int_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr, M, N, K, n_padded, k_tiles,
                       stride_xm, stride_om, group_size, BITS: tl.constexpr, HAS_ZERO: tl.constexpr,
                       HAS_BIAS: tl.constexpr, SCALE_PER_TILE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # axis 0 walks the outputs so that programs of one row block run together and share x in L2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    BYTES_K: tl.constexpr = BLOCK_K * BITS // 8  # bytes per tile row
    offsets = tl.arange(0, BYTES_K)
    tile = tl.arange(0, BLOCK_N)[:, None] * BYTES_K + offsets[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_ptr += pid_n.to(tl.int64) * k_tiles * BLOCK_N * BYTES_K
    for kt in range(k_tiles):
        packed = tl.load(w_ptr + kt * BLOCK_N * BYTES_K + tile)
        k_start = kt * BLOCK_K
        if BITS == 8:
            acc = _accumulate(acc, x_ptr, stride_xm, rows, row_mask, k_start, packed, offsets, K, n_padded, cols,
                              scale_ptr, zero_ptr, group_size, HAS_ZERO, SCALE_PER_TILE, DOT_IN_FP32)
        else:
            low = (packed & 0xF).to(tl.int32) - 8
            high = ((packed >> 4) & 0xF).to(tl.int32) - 8
            acc = _accumulate(acc, x_ptr, stride_xm, rows, row_mask, k_start, low, offsets, K, n_padded, cols,
                              scale_ptr, zero_ptr, group_size, HAS_ZERO, SCALE_PER_TILE, DOT_IN_FP32)
            acc = _accumulate(acc, x_ptr, stride_xm, rows, row_mask, k_start, high, offsets + BYTES_K, K, n_padded,
                              cols, scale_ptr, zero_ptr, group_size, HAS_ZERO, SCALE_PER_TILE, DOT_IN_FP32)
    col_mask = cols < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


# The CPU interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584, as in
# decode_attention.py): there bf16 operands are widened to fp32 first, which the products are anyway.
_INTERPRETED = isinstance(_linear_int_kernel, InterpretedFunction)


def linear_int(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] in fp16, bf16 or fp32 -> [..., N] in x's dtype (fp32 accumulation)."""
    if x.shape[-1] != weight.k:
        raise ValueError(f"x has {x.shape[-1]} inputs, the weight {weight.k}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"linear_int takes fp16, bf16 or fp32 activations, got {x.dtype}")
    rows = x.reshape(-1, weight.k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, weight.n), dtype=x.dtype, device=x.device)
    if m:
        dot_in_fp32 = x.dtype == torch.float32 or (_INTERPRETED and x.dtype == torch.bfloat16)
        # 32 rows at most: 64 spill registers on sm_89/sm_90 (ptxas, tests/kernels/test_linear_int_compiles.py)
        block_m = 16 if m <= 16 or x.dtype == torch.float32 else 32
        n_padded = weight.scales.shape[1]
        grid = (n_padded // BLOCK_N, triton.cdiv(m, block_m))
        _linear_int_kernel[grid](
            rows, weight.packed, weight.scales, weight.zero_points if weight.zero_points is not None else weight.scales,
            bias if bias is not None else weight.scales, out, m, weight.n, weight.k, n_padded, weight.packed.shape[1],
            rows.stride(0), out.stride(0), weight.group_size,
            BITS=weight.bits, HAS_ZERO=weight.zero_points is not None, HAS_BIAS=bias is not None,
            SCALE_PER_TILE=weight.scale_per_tile,
            DOT_IN_FP32=dot_in_fp32,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=weight.block_k, num_warps=4)
    return out.view(*x.shape[:-1], weight.n)


def linear_int_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                         group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch twin of :func:`linear_int` on the unpacked weight: dequantize to fp32, multiply in fp32."""
    k = q.shape[1]
    w = q.float()
    if zero_points is not None:
        w = w - zero_points.float().repeat_interleave(group_size, dim=1)[:, :k]
    w = w * scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
