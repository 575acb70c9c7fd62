from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference

# (head_dim, Hq, Hkv, block_size, dtype): each head dim, GQA ratio, block size and dtype appears,
# without the full cross product (the interpreter is slow)
SHAPES = [
    (64, 2, 2, 16, torch.float32),
    (128, 4, 2, 32, torch.bfloat16),
    (64, 4, 1, 16, torch.bfloat16),
    (128, 8, 2, 16, torch.float32),
    (64, 4, 2, 32, torch.float32),
]


def _seq_lens(block_size):
    # length 1, exactly one block, ending on a later block edge, and ragged past an edge
    return [1, block_size, 3 * block_size, 2 * block_size + 5]


@pytest.mark.parametrize("head_dim, num_query_heads, num_kv_heads, block_size, dtype", SHAPES)
def test_kernel_matches_reference(
    head_dim, num_query_heads, num_kv_heads, block_size, dtype, make_paged_kv, tolerances
):
    kv = make_paged_kv(_seq_lens(block_size), num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(len(kv.seq_lens), num_query_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_tensor, scale)

    out = paged_decode_attention(*args)

    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out, paged_decode_attention_reference(*args), **tolerances[dtype])


@pytest.mark.parametrize(
    "head_dim, num_query_heads, num_kv_heads, block_size, dtype, partition_size",
    [(64, 4, 2, 16, torch.float32, 16), (128, 2, 1, 32, torch.bfloat16, 32), (64, 2, 2, 16, torch.float32, 48)],
)
def test_split_k_partitions_merge_to_the_same_answer(
    head_dim, num_query_heads, num_kv_heads, block_size, dtype, partition_size, make_paged_kv, tolerances
):
    # several partitions per long sequence, and short sequences whose later partitions are empty
    seq_lens = [1, 5 * block_size + 3, block_size, 3 * block_size]
    kv = make_paged_kv(seq_lens, num_kv_heads, head_dim, block_size, dtype)
    query = torch.randn(len(seq_lens), num_query_heads, head_dim).to(dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_tensor, head_dim**-0.5)

    out = paged_decode_attention(*args, partition_size=partition_size)

    torch.testing.assert_close(out, paged_decode_attention_reference(*args), **tolerances[dtype])


def test_large_scores_do_not_overflow_the_softmax(make_paged_kv):
    # scores around 1e3: a softmax without max-subtraction would overflow to inf / nan
    kv = make_paged_kv([40, 7], 1, 64, 16, torch.float32)
    query = torch.randn(2, 2, 64) * 30
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_tensor, 1.0)

    out = paged_decode_attention(*args, partition_size=16)

    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, paged_decode_attention_reference(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_dim, num_query_heads, num_kv_heads", [(64, 2, 2), (128, 4, 2), (64, 4, 1)])
def test_reference_matches_dense_sdpa(head_dim, num_query_heads, num_kv_heads, make_paged_kv):
    block_size = 16
    kv = make_paged_kv(_seq_lens(block_size), num_kv_heads, head_dim, block_size, torch.float32)
    query = torch.randn(len(kv.seq_lens), num_query_heads, head_dim)
    scale = head_dim**-0.5

    out = paged_decode_attention_reference(
        query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_tensor, scale
    )

    group = num_query_heads // num_kv_heads
    for seq in range(len(kv.seq_lens)):
        # the contiguous K/V the cache was built from: [Hq, L, D]
        keys = kv.keys[seq].repeat_interleave(group, dim=1).transpose(0, 1)
        values = kv.values[seq].repeat_interleave(group, dim=1).transpose(0, 1)
        dense = F.scaled_dot_product_attention(query[seq][:, None, :], keys, values, scale=scale)[:, 0, :]
        torch.testing.assert_close(out[seq], dense, atol=1e-5, rtol=1e-5)


def test_contexts_longer_than_one_partition_split_by_default(make_paged_kv, tolerances):
    # 600 tokens > PARTITION_SIZE (512): the default launch takes the split-K path
    kv = make_paged_kv([600, 3], 1, 64, 16, torch.float32)
    query = torch.randn(2, 2, 64)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, kv.seq_lens_tensor, 0.125)

    out = paged_decode_attention(*args)

    torch.testing.assert_close(out, paged_decode_attention_reference(*args), **tolerances[torch.float32])


def test_a_block_table_padded_far_past_the_context_gives_the_same_answer(make_paged_kv, tolerances):
    # a CUDA graph's static block table is as wide as the longest allowed context (here 96 blocks
    # = 1536 tokens, so the default launch splits), whatever the batch's real lengths; the columns
    # past a sequence hold stale block ids that must never be read
    kv = make_paged_kv([37, 1, 300], 2, 64, 16, torch.float32)
    wide = torch.randint(0, kv.k_cache.shape[0], (3, 96), dtype=torch.int32)
    wide[:, : kv.block_tables.shape[1]] = kv.block_tables
    query = torch.randn(3, 4, 64)
    args = (query, kv.k_cache, kv.v_cache, wide, kv.seq_lens_tensor, 0.125)

    out = paged_decode_attention(*args)

    expected = paged_decode_attention_reference(query, kv.k_cache, kv.v_cache, kv.block_tables,
                                                kv.seq_lens_tensor, 0.125)
    torch.testing.assert_close(out, expected, **tolerances[torch.float32])
