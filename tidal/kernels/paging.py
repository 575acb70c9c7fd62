"""Shared Triton helper: where a tile of tokens' K/V rows sit in the paged cache.

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
