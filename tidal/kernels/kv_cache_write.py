"""Write each token's new K/V rows into the paged KV cache.

Layouts: key/value ``[T, Hkv, D]`` (any strides, last dim contiguous: they are usually views of
the fused qkv projection); caches ``[num_blocks, block_size, Hkv, D]`` contiguous;
``slot_mapping[t] = block_id * block_size + offset`` (int64). A negative slot writes nothing: the
CUDA-graph runner pads a batch up to a captured size with such rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    num_kv_heads,
    head_dim,
    block_size,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per token: its Hkv x D rows are one small 2-D tile
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block_id = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    heads_to_write = tl.where(slot >= 0, num_kv_heads, 0)  # a negative slot is a padding row
    mask = (heads[:, None] < heads_to_write) & (dims[None, :] < head_dim)
    token64 = token.to(tl.int64)

    key = tl.load(key_ptr + token64 * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token64 * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask
    )
    # int64 block offset: a large cache layer holds more than 2**31 elements
    dst = (
        block_id * stride_cache_block
        + offset * stride_cache_offset
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy ``key[t]``/``value[t]`` (``[T, Hkv, D]``) into the caches at ``slot_mapping[t]``, in place;
    rows whose slot is negative are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_layouts(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch twin of :func:`reshape_and_cache`."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_ids = slots // block_size
    offsets = slots % block_size
    k_cache[block_ids, offsets] = key[keep]
    v_cache[block_ids, offsets] = value[keep]


def _check_layouts(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"caches {tuple(k_cache.shape)} do not fit key/value {tuple(key.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError("key/value must already be in the cache dtype")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key/value need a contiguous last dimension")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must be contiguous with identical strides")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [T]={key.shape[0]}, got {tuple(slot_mapping.shape)}")
