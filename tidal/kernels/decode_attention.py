"""Decode attention: one query token per sequence against its paged K/V, with grouped-query heads.

Layouts: query ``[B, Hq, D]``; caches ``[num_blocks, block_size, Hkv, D]``; block_tables
``[B, max_blocks]`` int32; seq_lens ``[B]`` int32 (>= 1, includes the query token, whose K/V are
already cached). Query head h reads kv head ``h // (Hq // Hkv)``.

One program owns (sequence, kv head, context partition) and all ``Hq // Hkv`` query heads that
share the kv head, so each K/V tile is read from memory once per group. It walks its partition in
tiles of ``TILE_N`` tokens, gathering each token's block id from the block table, and keeps an fp32
online softmax. With more than one partition (split-K, for long contexts at small batch), every
partition writes an unnormalised fp32 partial and a second kernel merges them.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .paging import online_softmax_tile, paged_kv_offsets

# tokens per K/V tile (>= 16 so tl.dot maps onto tensor cores)
TILE_N = 64
# tokens per split-K partition; contexts up to this length never split
PARTITION_SIZE = 512
# split-K only while the unsplit grid would leave SMs idle
_PROGRAMS_PER_SM = 2
# at most this many partitions per sequence: a CUDA-graph batch pads its block table to the longest
# allowed context (131072 tokens for Llama 3.1), and 256 partitions of 512 tokens, nearly all empty,
# would be a grid of idle programs and a partial buffer hundreds of MB large
MAX_PARTITIONS = 32
_LOG2_E = 1.4426950408889634


@triton.jit
def _decode_partition_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    scale_log2,
    stride_query_b,
    stride_query_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_tables,
    stride_out_b,
    stride_out_h,
    stride_partial_b,
    stride_partial_h,
    stride_partial_acc_p,
    stride_partial_acc_b,
    stride_partial_acc_h,
    block_size,
    head_dim,
    group_size,
    partition_size,
    TILE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # an empty partition (past the end of a shorter sequence) runs no tiles and writes a
    # zero-weight partial that the merge ignores
    start = partition * partition_size
    end = tl.minimum(seq_len, start + partition_size)

    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * group_size + group
    head_mask = group < group_size
    dim_mask = dims < head_dim
    query = tl.load(
        query_ptr + seq.to(tl.int64) * stride_query_b + heads[:, None] * stride_query_h + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if DOT_IN_FP32:
        query = query.to(tl.float32)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # in log2 units
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_block_tables
    for tile_start in range(start, end, TILE):
        tokens = tile_start + tl.arange(0, TILE)
        token_mask = tokens < end
        kv_offsets = paged_kv_offsets(block_table, tokens, token_mask, block_size, kv_head, dims,
                                      stride_cache_block, stride_cache_offset, stride_cache_head)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        keys = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if DOT_IN_FP32:
            keys = keys.to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        running_max, running_sum, acc = online_softmax_tile(
            scores, running_max, running_sum, acc, v_cache_ptr, kv_offsets, kv_mask, DOT_IN_FP32, DOT_PRECISION)

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        partial = seq.to(tl.int64) * stride_partial_b + heads * stride_partial_h + partition
        tl.store(partial_max_ptr + partial, running_max, mask=head_mask)
        tl.store(partial_sum_ptr + partial, running_sum, mask=head_mask)
        acc_offsets = (
            partition.to(tl.int64) * stride_partial_acc_p
            + seq.to(tl.int64) * stride_partial_acc_b
            + heads[:, None] * stride_partial_acc_h
            + dims[None, :]
        )
        tl.store(partial_acc_ptr + acc_offsets, acc, mask=out_mask)
    else:
        out = acc / running_sum[:, None]
        out_offsets = seq.to(tl.int64) * stride_out_b + heads[:, None] * stride_out_h + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_partitions_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_out_b,
    stride_out_h,
    stride_partial_b,
    stride_partial_h,
    stride_partial_acc_p,
    stride_partial_acc_b,
    stride_partial_acc_h,
    num_partitions,
    head_dim,
    PARTITIONS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per (sequence, query head): rescale each partition's partial to a common max
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    parts = tl.arange(0, PARTITIONS_PAD)
    dims = tl.arange(0, BLOCK_D)
    part_mask = parts < num_partitions
    dim_mask = dims < head_dim
    partial = seq * stride_partial_b + head * stride_partial_h + parts
    maxes = tl.load(partial_max_ptr + partial, mask=part_mask, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + partial, mask=part_mask, other=0.0)
    global_max = tl.max(maxes, axis=0)  # finite: partition 0 always holds a token
    weights = tl.math.exp2(maxes - global_max)
    total = tl.sum(weights * sums, axis=0)
    acc_offsets = (
        parts[:, None].to(tl.int64) * stride_partial_acc_p
        + seq * stride_partial_acc_b
        + head * stride_partial_acc_h
        + dims[None, :]
    )
    accs = tl.load(partial_acc_ptr + acc_offsets, mask=part_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(accs * weights[:, None], axis=0) / total
    tl.store(
        out_ptr + seq * stride_out_b + head * stride_out_h + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask
    )


# The CPU interpreter multiplies bf16 bit patterns in tl.dot (it has no bf16 arithmetic,
# triton-lang/triton#11584), so under TRITON_INTERPRET=1 the operands are widened to fp32 first.
# bf16 x bf16 products are exact in fp32, so the maths is the same as on the GPU.
_INTERPRETED = isinstance(_decode_partition_kernel, InterpretedFunction)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of each sequence's last token over its whole cached context; returns ``[B, Hq, D]``.

    ``partition_size`` (tokens, a multiple of 16) sets the split-K partition length;
    by default the launcher splits only when the unsplit grid is too small to fill the GPU.
    Never reads ``seq_lens`` on the host, so it is safe to capture in a CUDA graph.
    """
    _check_layouts(query, k_cache, v_cache, block_tables, seq_lens)
    batch, num_query_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group_size = num_query_heads // num_kv_heads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    # the padded block table bounds every context without a device->host sync
    max_context = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = _default_partition_size(batch * num_kv_heads, max_context, query.device)
    if partition_size <= 0 or partition_size % 16:
        raise ValueError(f"partition_size must be a multiple of 16, got {partition_size}")
    num_partitions = max(1, math.ceil(max_context / partition_size))
    split = num_partitions > 1

    if split:
        partial_max = torch.empty(batch, num_query_heads, num_partitions, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
        # [B, Hq, partitions, D]: the merge reads one contiguous slab per (sequence, head)
        partial_acc = torch.empty(
            batch, num_query_heads, num_partitions, head_dim, dtype=torch.float32, device=query.device
        )
    else:
        partial_max = partial_sum = partial_acc = out  # placeholders, never touched
    _decode_partition_kernel[(batch, num_kv_heads, num_partitions)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        partial_acc,
        partial_max,
        partial_sum,
        scale * _LOG2_E,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        partial_max.stride(0) if split else 0,
        partial_max.stride(1) if split else 0,
        partial_acc.stride(2) if split else 0,
        partial_acc.stride(0) if split else 0,
        partial_acc.stride(1) if split else 0,
        block_size,
        head_dim,
        group_size,
        partition_size,
        TILE=math.gcd(TILE_N, partition_size),
        GROUP_PAD=max(16, triton.next_power_of_2(group_size)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        SPLIT=split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=_INTERPRETED,
    )
    if split:
        _merge_partitions_kernel[(batch, num_query_heads)](
            out,
            partial_acc,
            partial_max,
            partial_sum,
            out.stride(0),
            out.stride(1),
            partial_max.stride(0),
            partial_max.stride(1),
            partial_acc.stride(2),
            partial_acc.stride(0),
            partial_acc.stride(1),
            num_partitions,
            head_dim,
            PARTITIONS_PAD=triton.next_power_of_2(num_partitions),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


def paged_decode_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-torch twin of :func:`paged_decode_attention` (one sequence at a time, fp32 softmax)."""
    batch, num_query_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group_size = num_query_heads // num_kv_heads
    out = torch.empty_like(query)
    for seq in range(batch):
        seq_len = int(seq_lens[seq])
        positions = torch.arange(seq_len, device=query.device)
        block_ids = block_tables[seq].long()[positions // block_size]
        keys = k_cache[block_ids, positions % block_size].float()  # [L, Hkv, D]
        values = v_cache[block_ids, positions % block_size].float()
        keys = keys.repeat_interleave(group_size, dim=1)  # [L, Hq, D]
        values = values.repeat_interleave(group_size, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[seq].float(), keys) * scale
        probs = torch.softmax(scores, dim=-1)
        out[seq] = torch.einsum("hl,lhd->hd", probs, values).to(query.dtype)
    return out


def _default_partition_size(num_programs: int, max_context: int, device: torch.device) -> int:
    unsplit = 16 * math.ceil(max_context / 16)
    if max_context <= PARTITION_SIZE:
        return unsplit
    if device.type == "cuda":
        sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        if num_programs >= _PROGRAMS_PER_SM * sm_count:
            # the grid already fills the GPU: one partition per sequence avoids the merge pass
            return unsplit
    return max(PARTITION_SIZE, TILE_N * math.ceil(max_context / (TILE_N * MAX_PARTITIONS)))


def _check_layouts(query, k_cache, v_cache, block_tables, seq_lens) -> None:
    if query.dim() != 3 or query.stride(2) != 1:
        raise ValueError(f"query must be [B, Hq, D] with a contiguous last dimension, got {tuple(query.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[3] != query.shape[2]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit query {tuple(query.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError(f"Hq={query.shape[1]} is not a multiple of Hkv={k_cache.shape[2]}")
    if query.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise ValueError("query and caches must share a dtype")
    if block_tables.dim() != 2 or block_tables.shape[0] != query.shape[0] or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must be [B, max_blocks] row-major, got {tuple(block_tables.shape)}")
    if seq_lens.shape != (query.shape[0],):
        raise ValueError(f"seq_lens must be [B]={query.shape[0]}, got {tuple(seq_lens.shape)}")
