from __future__ import annotations

import pytest
import torch

from tidal.kernels.kv_cache_write import reshape_and_cache, reshape_and_cache_reference


def _fused_kv(num_tokens, num_kv_heads, head_dim, dtype):
    """key and value as strided views of one [T, 3*Hkv*D] tensor, as the qkv projection leaves them."""
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim).to(dtype)
    _, key, value = qkv.split(num_kv_heads * head_dim, dim=1)
    return key.view(num_tokens, num_kv_heads, head_dim), value.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize(
    "head_dim, num_kv_heads, block_size, dtype",
    [
        (64, 2, 16, torch.float32),
        (128, 1, 32, torch.bfloat16),
        (64, 3, 32, torch.bfloat16),
        (128, 2, 16, torch.float32),
    ],
)
def test_kernel_writes_the_same_cache_as_the_reference(head_dim, num_kv_heads, block_size, dtype):
    num_blocks, num_tokens = 6, 11
    key, value = _fused_kv(num_tokens, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]  # scattered over shuffled blocks
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()

    reshape_and_cache(key, value, k_cache, v_cache, slots)
    reshape_and_cache_reference(key, value, k_expected, v_expected, slots)

    assert torch.equal(k_cache, k_expected)
    assert torch.equal(v_cache, v_expected)


def test_reference_puts_each_row_at_its_slot_and_nothing_else():
    block_size, num_kv_heads, head_dim = 16, 2, 64
    key, value = _fused_kv(3, num_kv_heads, head_dim, torch.float32)
    k_cache = torch.zeros(4, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([2 * block_size + 15, 0, 3 * block_size + 1])  # block 2 last offset, ...

    reshape_and_cache_reference(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache[2, 15], key[0]) and torch.equal(v_cache[2, 15], value[0])
    assert torch.equal(k_cache[0, 0], key[1]) and torch.equal(v_cache[0, 0], value[1])
    assert torch.equal(k_cache[3, 1], key[2]) and torch.equal(v_cache[3, 1], value[2])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3


def test_a_negative_slot_writes_nothing():
    # the CUDA-graph runner pads a batch up to a captured size with rows whose slot is -1
    block_size, num_kv_heads, head_dim = 16, 2, 64
    key, value = _fused_kv(4, num_kv_heads, head_dim, torch.float32)
    k_cache = torch.randn(3, block_size, num_kv_heads, head_dim)
    v_cache = torch.randn_like(k_cache)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([block_size + 3, -1, 5, -1])

    reshape_and_cache(key, value, k_cache, v_cache, slots)

    k_before[1, 3], v_before[1, 3] = key[0], value[0]
    k_before[0, 5], v_before[0, 5] = key[2], value[2]
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
