from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_reference

SHAPES = [
    (64, 2, 2, 16, torch.float32),
    (128, 4, 2, 32, torch.bfloat16),
    (64, 4, 1, 16, torch.bfloat16),
    (128, 8, 2, 16, torch.float32),
    (64, 4, 2, 32, torch.float32),
]


def _chunks(block_size):
    """(query_len, seq_len) per sequence: the chunk is the last query_len tokens of the context."""
    return [
        (5, 5),  # a fresh prompt
        (1, 1),  # a one-token prompt
        (block_size + 4, 2 * block_size),  # a chunk extending a cached prefix, ending on a block edge
        (3, 4 * block_size + 9),  # a prefix-cache hit (> 64 keys: several key tiles)
        (20, 20),  # a prompt spanning several query tiles when heads are grouped
    ]


def _batch(chunks, num_query_heads, num_kv_heads, head_dim, block_size, dtype, make_paged_kv):
    kv = make_paged_kv([seq_len for _, seq_len in chunks], num_kv_heads, head_dim, block_size, dtype)
    query_lens = [query_len for query_len, _ in chunks]
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_query_heads, head_dim).to(dtype)
    return kv, query, query_start_loc


@pytest.mark.parametrize("head_dim, num_query_heads, num_kv_heads, block_size, dtype", SHAPES)
def test_kernel_matches_reference(
    head_dim, num_query_heads, num_kv_heads, block_size, dtype, make_paged_kv, tolerances
):
    chunks = _chunks(block_size)
    kv, query, query_start_loc = _batch(
        chunks, num_query_heads, num_kv_heads, head_dim, block_size, dtype, make_paged_kv
    )
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens_tensor, head_dim**-0.5)

    out = paged_prefill_attention(*args, max_query_len=max(q for q, _ in chunks))

    assert out.shape == query.shape and out.dtype == dtype
    torch.testing.assert_close(out, paged_prefill_attention_reference(*args), **tolerances[dtype])


def test_grid_size_is_read_from_query_start_loc_when_not_given(make_paged_kv, tolerances):
    chunks = [(2, 9), (7, 7)]
    kv, query, query_start_loc = _batch(chunks, 2, 2, 64, 16, torch.float32, make_paged_kv)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens_tensor, 0.125)

    out = paged_prefill_attention(*args)

    torch.testing.assert_close(out, paged_prefill_attention_reference(*args), **tolerances[torch.float32])


@pytest.mark.parametrize("head_dim, num_query_heads, num_kv_heads", [(64, 2, 2), (128, 4, 2), (64, 4, 1)])
def test_reference_matches_dense_causal_sdpa(head_dim, num_query_heads, num_kv_heads, make_paged_kv):
    block_size = 16
    chunks = _chunks(block_size)
    kv, query, query_start_loc = _batch(
        chunks, num_query_heads, num_kv_heads, head_dim, block_size, torch.float32, make_paged_kv
    )
    scale = head_dim**-0.5

    out = paged_prefill_attention_reference(
        query, kv.k_cache, kv.v_cache, kv.block_tables, query_start_loc, kv.seq_lens_tensor, scale
    )

    group = num_query_heads // num_kv_heads
    for seq, (query_len, seq_len) in enumerate(chunks):
        rows = slice(int(query_start_loc[seq]), int(query_start_loc[seq + 1]))
        keys = kv.keys[seq].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
        values = kv.values[seq].repeat_interleave(group, dim=1).transpose(0, 1)
        # query i is at position seq_len - query_len + i: a causal mask offset by the cached prefix
        visible = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
        dense = F.scaled_dot_product_attention(
            query[rows].transpose(0, 1), keys, values, attn_mask=visible, scale=scale
        ).transpose(0, 1)
        torch.testing.assert_close(out[rows], dense, atol=1e-5, rtol=1e-5)
