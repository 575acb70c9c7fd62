"""Shared Triton helpers of the attention kernels: paged K/V addresses and the online softmax.

Both attention kernels walk a sequence's context in tiles of token positions and read each
tile's K and V rows through the sequence's block table; this is that address computation.
Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_kv_offsets(block_table, positions, position_mask, block_size, kv_head, dims,
                     stride_cache_block, stride_cache_offset, stride_cache_head):
    """Element offsets ``[TILE, BLOCK_D]`` of the K/V rows at ``positions`` for ``kv_head``."""
    block_ids = tl.load(block_table + positions // block_size, mask=position_mask, other=0).to(tl.int64)
    return (
        block_ids[:, None] * stride_cache_block
        + (positions % block_size)[:, None] * stride_cache_offset
        + kv_head * stride_cache_head
        + dims[None, :]
    )


@triton.jit
def online_softmax_tile(scores, running_max, running_sum, acc, v_cache_ptr, kv_offsets, kv_mask,
                        DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile of masked scores (log2 units, -inf where hidden) into the running softmax.

    Returns the new (running_max, running_sum, acc). A row that has seen no visible key yet
    keeps max -inf; it subtracts 0 instead, so no nan appears.
    """
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    correction = tl.math.exp2(running_max - safe_max)
    probs = tl.math.exp2(scores - safe_max[:, None])
    running_sum = running_sum * correction + tl.sum(probs, axis=1)
    values = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    # probabilities are rounded to the cache dtype so the second product also runs on tensor cores
    probs = probs.to(v_cache_ptr.dtype.element_ty)
    if DOT_IN_FP32:
        values = values.to(tl.float32)
        probs = probs.to(tl.float32)
    acc = acc * correction[:, None] + tl.dot(probs, values, input_precision=DOT_PRECISION)
    return new_max, running_sum, acc
