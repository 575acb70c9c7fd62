from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tidal.kernels.rotary import rotary_embedding, rotary_embedding_reference

MAX_POSITION = 64


def _cos_sin_caches(head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(MAX_POSITION, dtype=torch.float32), inv_freq)  # [max_pos, D/2]
    return angles.cos(), angles.sin()


def _fused_qk(num_tokens, num_query_heads, num_kv_heads, head_dim, dtype):
    """query and key as strided views of one qkv tensor, as the model hands them over."""
    qkv = torch.randn(num_tokens, (num_query_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    query, key, _ = qkv.split([num_query_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    return query.view(num_tokens, num_query_heads, head_dim), key.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize(
    "head_dim, num_query_heads, num_kv_heads, dtype",
    [
        (64, 2, 2, torch.float32),
        (128, 4, 2, torch.bfloat16),
        (64, 8, 2, torch.bfloat16),
        (128, 3, 1, torch.float32),
    ],
)
def test_kernel_matches_reference(head_dim, num_query_heads, num_kv_heads, dtype, tolerances):
    positions = torch.tensor([0, 5, 63, 17, 17, 1])
    query, key = _fused_qk(len(positions), num_query_heads, num_kv_heads, head_dim, dtype)
    cos, sin = _cos_sin_caches(head_dim)

    query_out, key_out = rotary_embedding(positions, query, key, cos, sin)
    expected_query, expected_key = rotary_embedding_reference(positions, query, key, cos, sin)

    assert query_out.dtype == dtype and key_out.dtype == dtype
    torch.testing.assert_close(query_out, expected_query, **tolerances[dtype])
    torch.testing.assert_close(key_out, expected_key, **tolerances[dtype])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_hf_apply_rotary_pos_emb(head_dim):
    positions = torch.tensor([3, 0, 40, 41])
    query, key = _fused_qk(len(positions), 4, 2, head_dim, torch.float32)
    cos, sin = _cos_sin_caches(head_dim)

    query_out, key_out = rotary_embedding_reference(positions, query, key, cos, sin)

    # HF builds the full-width cos/sin as cat(freqs, freqs); [T, D] broadcast over heads (dim 1)
    cos_full = torch.cat((cos, cos), dim=-1)[positions]
    sin_full = torch.cat((sin, sin), dim=-1)[positions]
    hf_query, hf_key = apply_rotary_pos_emb(query, key, cos_full, sin_full, unsqueeze_dim=1)
    torch.testing.assert_close(query_out, hf_query, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(key_out, hf_key, atol=1e-6, rtol=1e-6)


def test_position_zero_is_the_identity():
    query, key = _fused_qk(1, 2, 1, 64, torch.float32)
    cos, sin = _cos_sin_caches(64)
    query_out, key_out = rotary_embedding(torch.tensor([0]), query, key, cos, sin)
    torch.testing.assert_close(query_out, query)
    torch.testing.assert_close(key_out, key)


def test_per_token_cos_sin_rows_give_the_same_rotation(tolerances):
    # the model computes cos/sin once per forward, one row per token: positions=None reads row t
    positions = torch.tensor([0, 5, 63, 17])
    query, key = _fused_qk(len(positions), 4, 2, 64, torch.bfloat16)
    cos, sin = _cos_sin_caches(64)
    per_token_cos = torch.cat((cos[positions], cos[positions]), dim=1)[:, :32]  # a strided [T, D/2] view
    per_token_sin = torch.cat((sin[positions], sin[positions]), dim=1)[:, :32]

    got = rotary_embedding(None, query, key, per_token_cos, per_token_sin)

    for g, want in zip(got, rotary_embedding_reference(positions, query, key, cos, sin)):
        torch.testing.assert_close(g, want, **tolerances[torch.bfloat16])
