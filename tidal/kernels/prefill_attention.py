"""Prefill attention: causal attention of prompt chunks over their paged K/V, grouped-query heads.

Layouts: query ``[T, Hq, D]`` is P sequences' chunks back to back, sequence p owning rows
``query_start_loc[p]:query_start_loc[p+1]`` (int32 ``[P+1]``); seq_lens ``[P]`` int32 is the whole
context including the chunk, whose K/V are already cached; caches ``[num_blocks, block_size, Hkv, D]``;
block_tables ``[P, max_blocks]`` int32. Query i of sequence p sits at absolute position
``seq_len - q_len + i`` and sees keys ``0..position``, all read through the block table, so one kernel
covers a fresh prompt, the next chunk of a long prompt and a prompt whose prefix is cached.

One program owns (tile of BLOCK_M chunk tokens, sequence, kv head). Its tile rows are the
(token, query head) pairs of the ``Hq // Hkv`` heads sharing that kv head, so each K/V tile is loaded
once per group. It walks keys in tiles of ``TILE_N`` tokens up to its last row's position, with a
causal mask and an fp32 online softmax.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .paging import online_softmax_tile, paged_kv_offsets

# (token, head) rows per query tile and tokens per K/V tile (>= 16 for tensor cores)
BLOCK_ROWS = 64
TILE_N = 64
_LOG2_E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    stride_query_t,
    stride_query_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_tables,
    stride_out_t,
    stride_out_h,
    block_size,
    head_dim,
    group_size,
    BLOCK_M: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    query_tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - query_len  # keys before this chunk

    # row r is (chunk token r // GROUP_PAD, group head r % GROUP_PAD)
    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    chunk_tokens = query_tile * BLOCK_M + rows // GROUP_PAD
    group = rows % GROUP_PAD
    heads = kv_head * group_size + group
    row_mask = (chunk_tokens < query_len) & (group < group_size)
    positions = cached_len + chunk_tokens
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < head_dim
    io_mask = row_mask[:, None] & dim_mask[None, :]
    query_rows = (query_start + chunk_tokens).to(tl.int64)
    query = tl.load(
        query_ptr + query_rows[:, None] * stride_query_t + heads[:, None] * stride_query_h + dims[None, :],
        mask=io_mask,
        other=0.0,
    )
    if DOT_IN_FP32:
        query = query.to(tl.float32)

    # keys up to the tile's last position; a tile wholly past the chunk (the grid is sized for
    # the longest chunk) runs no iterations and stores nothing
    tile_end = tl.minimum(query_len, (query_tile + 1) * BLOCK_M)
    key_end = tl.where(query_tile * BLOCK_M < query_len, cached_len + tile_end, 0)

    running_max = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)  # in log2 units
    running_sum = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables
    for tile_start in range(0, key_end, TILE):
        keys_pos = tile_start + tl.arange(0, TILE)
        key_mask = keys_pos < key_end
        kv_offsets = paged_kv_offsets(block_table, keys_pos, key_mask, block_size, kv_head, dims,
                                      stride_cache_block, stride_cache_offset, stride_cache_head)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            keys = keys.to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
        visible = (keys_pos[None, :] <= positions[:, None]) & key_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        running_max, running_sum, acc = online_softmax_tile(
            scores, running_max, running_sum, acc, v_cache_ptr, kv_offsets, kv_mask, DOT_IN_FP32, DOT_PRECISION)

    out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
    tl.store(
        out_ptr + query_rows[:, None] * stride_out_t + heads[:, None] * stride_out_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


# See decode_attention.py: the CPU interpreter has no bf16 tl.dot (triton-lang/triton#11584).
_INTERPRETED = isinstance(_prefill_kernel, InterpretedFunction)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of every chunk token over its sequence's cached context; returns ``[T, Hq, D]``.

    ``max_query_len`` (the longest chunk) sizes the grid; pass it when known on the host
    (ForwardBatch.prefill_query_lens) to avoid reading ``query_start_loc`` back from the device.
    """
    _check_layouts(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    num_tokens, num_query_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    group_size = num_query_heads // num_kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group_pad = triton.next_power_of_2(group_size)
    block_m = max(1, BLOCK_ROWS // group_pad)
    grid = (math.ceil(max_query_len / block_m), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2_E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.shape[1],
        head_dim,
        group_size,
        BLOCK_M=block_m,
        GROUP_PAD=group_pad,
        TILE=TILE_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=_INTERPRETED,
    )
    return out


def paged_prefill_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch twin of :func:`paged_prefill_attention` (one sequence at a time, fp32 softmax)."""
    num_query_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_query_heads // num_kv_heads
    out = torch.empty_like(query)
    for seq in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        seq_len = int(seq_lens[seq])
        key_positions = torch.arange(seq_len, device=query.device)
        block_ids = block_tables[seq].long()[key_positions // block_size]
        keys = k_cache[block_ids, key_positions % block_size].float().repeat_interleave(group_size, dim=1)
        values = v_cache[block_ids, key_positions % block_size].float().repeat_interleave(group_size, dim=1)
        query_positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        scores = torch.einsum("qhd,khd->hqk", query[start:end].float(), keys) * scale
        visible = key_positions[None, :] <= query_positions[:, None]  # [q, k] causal mask
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, values).to(query.dtype)
    return out


def _check_layouts(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens) -> None:
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(f"query must be [T, Hq, D] with a contiguous last dimension, got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != query.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit query {tuple(query.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"Hq={query.shape[1]} is not a multiple of Hkv={k_cache.shape[2]}")
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("query and caches must share a dtype")
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc must be [P+1]={num_seqs + 1}, got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [P, max_blocks] row-major, got {tuple(block_tables.shape)}")
