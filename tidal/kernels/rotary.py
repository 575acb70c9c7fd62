"""Rotary position embedding, NeoX / HF-Llama "rotate_half" style.

For each head vector x of width D: x1 = x[:D/2], x2 = x[D/2:],
out = cat(x1*cos - x2*sin, x2*cos + x1*sin) with cos/sin = cache[position] (``[max_pos, D/2]`` fp32).
Computed in fp32, written in the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_token_heads(
    src_ptr,
    dst_ptr,
    stride_src_h,
    stride_dst_h,
    num_heads,
    cos,
    sin,
    half_dims,
    dim_mask,
    half,
    BLOCK_H: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & dim_mask[None, :]
    src = src_ptr + heads[:, None] * stride_src_h + half_dims[None, :]
    dst = dst_ptr + heads[:, None] * stride_dst_h + half_dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    out_dtype = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(out_dtype), mask=mask)
    tl.store(dst + half, (x2 * cos[None, :] + x1 * sin[None, :]).to(out_dtype), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    query_out_ptr,
    key_out_ptr,
    cos_ptr,
    sin_ptr,
    stride_query_t,
    stride_query_h,
    stride_key_t,
    stride_key_h,
    stride_query_out_t,
    stride_query_out_h,
    stride_key_out_t,
    stride_key_out_h,
    stride_cos,
    num_query_heads,
    num_kv_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PER_TOKEN: tl.constexpr,
):
    # one program per token: cos/sin are loaded once and shared by all of its q and k heads
    token = tl.program_id(0).to(tl.int64)
    if PER_TOKEN:  # cos/sin row t belongs to token t
        position = token
    else:
        position = tl.load(positions_ptr + token)
    half_dims = tl.arange(0, BLOCK_HALF)
    dim_mask = half_dims < half
    cos = tl.load(cos_ptr + position * stride_cos + half_dims, mask=dim_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + position * stride_cos + half_dims, mask=dim_mask, other=0.0).to(tl.float32)
    _rotate_token_heads(
        query_ptr + token * stride_query_t,
        query_out_ptr + token * stride_query_out_t,
        stride_query_h,
        stride_query_out_h,
        num_query_heads,
        cos,
        sin,
        half_dims,
        dim_mask,
        half,
        BLOCK_HQ,
    )
    _rotate_token_heads(
        key_ptr + token * stride_key_t,
        key_out_ptr + token * stride_key_out_t,
        stride_key_h,
        stride_key_out_h,
        num_kv_heads,
        cos,
        sin,
        half_dims,
        dim_mask,
        half,
        BLOCK_HKV,
    )


def rotary_embedding(
    positions: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hkv, D]`` by their ``positions`` ``[T]``.

    ``positions=None``: the caches are already per token (row t is token t's cos/sin, ``[T, D/2]``,
    any row stride), as the model computes them once per forward pass.

    Returns new contiguous tensors; the inputs may be strided views (last dim contiguous).
    """
    _check_layouts(positions, query, key, cos_cache, sin_cache)
    num_tokens, num_query_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    key_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return query_out, key_out
    half = head_dim // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions if positions is not None else cos_cache,  # unused per token
        query,
        key,
        query_out,
        key_out,
        cos_cache,
        sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        query_out.stride(0),
        query_out.stride(1),
        key_out.stride(0),
        key_out.stride(1),
        cos_cache.stride(0),
        num_query_heads,
        num_kv_heads,
        half,
        BLOCK_HQ=triton.next_power_of_2(num_query_heads),
        BLOCK_HKV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        PER_TOKEN=positions is None,
    )
    return query_out, key_out


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch twin of :func:`rotary_embedding`."""
    cos = cos_cache[positions].float()[:, None, :]  # [T, 1, D/2], broadcast over heads
    sin = sin_cache[positions].float()[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def _check_layouts(positions, query, key, cos_cache, sin_cache) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query [T, Hq, D] and key [T, Hkv, D] disagree: {tuple(query.shape)}, {tuple(key.shape)}")
    if query.shape[2] % 2:
        raise ValueError("head_dim must be even")
    if query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError("query/key need a contiguous last dimension")
    if positions is None:
        if cos_cache.shape[0] != query.shape[0]:
            raise ValueError(f"per-token cos/sin must have T={query.shape[0]} rows, got {cos_cache.shape[0]}")
    elif positions.shape != (query.shape[0],):
        raise ValueError(f"positions must be [T]={query.shape[0]}, got {tuple(positions.shape)}")
    expected = (query.shape[2] // 2,)
    if cos_cache.shape[1:] != expected or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos/sin caches must be [max_position, {expected[0]}]")
    if cos_cache.stride(1) != 1 or cos_cache.stride() != sin_cache.stride():
        raise ValueError("cos/sin caches must be row-major with identical strides")
