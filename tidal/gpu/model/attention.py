"""Paged attention: plain torch (the CPU path) and the Triton kernels (the CUDA path), chosen in one place.

Every call first writes the batch's new K/V rows into the paged cache, then attends:

* decodes (rows ``[0, num_decodes)``) all at once: on CPU by a small C++ kernel
  (``tidal/gpu/cpu/kernels.py``) that reads K/V straight through the block tables; otherwise
  their blocks are gathered into one padded ``[B, L, Hkv, D]`` tensor and positions past each
  sequence's length are masked out;
* prefill chunks one by one (there are few per step): causal attention whose diagonal is
  shifted by the context already cached (``seq_len - q_len``); a chunk that is the whole
  sequence uses its fresh K/V directly instead of reading them back from the cache. Where the
  C++ kernel has its AVX512-BF16 path (a bf16 cache on a CPU with the instructions), prefill
  rows go through it too, with the decodes in one call: row i of a chunk is one query whose
  sequence ends at its own position, 2-3x faster than SDPA's CPU flash attention in bf16.

All attention goes through ``scaled_dot_product_attention`` with ``enable_gqa=True`` so K/V
heads are never repeated in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tidal.gpu.cpu.kernels import load_cpu_ops, load_decode_kernel
from tidal.gpu.forward_batch import ForwardBatch


@dataclass
class _DecodePlan:
    """Per-batch tensors every layer's decode attention reuses (computed once per forward)."""

    block_ids: torch.Tensor  # [B * blocks_per_seq] int64: the blocks to gather, row-major
    blocks_per_seq: int
    mask: torch.Tensor  # [B, 1, 1, L] bool: True where the key position is inside the sequence


class TorchPagedAttention:
    """Paged attention over the ``[num_blocks, block_size, num_kv_heads, head_dim]`` KV cache.

    Stateful only in two harmless ways: it keeps gather buffers between calls (large fresh
    allocations page-fault on every step, which costs more than the copy itself), and it
    caches the decode plan of the last ``ForwardBatch`` it saw, so a batch must not be
    mutated after its first forward.
    """

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._plan_batch: ForwardBatch | None = None
        self._plan: _DecodePlan | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        # built (or loaded from cache) here, at model load, never in the hot path; None: gather + SDPA
        self._cpu_decode = load_decode_kernel() if torch.device(device).type == "cpu" else None
        # the cache write as one op (csrc/paged_decode.cpp) where the kernels built; else index_copy_
        self._cpu_write = None if self._cpu_decode is None else load_cpu_ops().write_kv_cache_
        self._rows_on_kernel: dict[int, bool] = {}  # head dim -> whether prefill rows go through the kernel
        self._rows_batch: ForwardBatch | None = None
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # that batch's row tables and lengths

    def kernel_rows(self, batch: ForwardBatch, dtype: torch.dtype,
                    k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where ``forward`` would write and attend every row of ``batch`` with the C++ ops alone (queries of
        ``dtype``): each row's (block tables, lengths) as the kernel takes them; else None.

        The model's one-call decoder stack (csrc/decoder_stack.cpp) runs those same ops itself.
        """
        if not self._decode_on_kernel(dtype, k_cache):
            return None
        if batch.num_prefills == 0:
            return (batch.decode_block_tables, batch.decode_seq_lens) if batch.num_decodes else None
        return self._row_plan(batch) if self._prefill_on_kernel(dtype, k_cache) else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """Store ``key``/``value`` [T, Hkv, D] at ``batch.slot_mapping``, return attention output [T, Hq, D]."""
        if self._cpu_write is not None and key.dtype == k_cache.dtype:  # set only for a CPU backend
            self._cpu_write(key, value, k_cache, v_cache, batch.slot_mapping)
        else:
            write_kv_cache(key, value, k_cache, v_cache, batch.slot_mapping)
        rows = self.kernel_rows(batch, query.dtype, k_cache)
        if rows is not None:  # every row on the C++ kernel
            return self._cpu_decode(query, k_cache, v_cache, *rows, scale)
        num_decodes = batch.num_decodes
        if batch.num_prefills == 0:
            if num_decodes == 0:
                return torch.empty_like(query)
            return self._decode(query, k_cache, v_cache, batch, scale)
        out = torch.empty_like(query)
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], k_cache, v_cache, batch, scale)
        start = num_decodes
        for p, (q_len, seq_len) in enumerate(zip(batch.prefill_query_lens, batch.prefill_seq_lens)):
            end = start + q_len
            if seq_len == q_len:
                out[start:end] = _causal_attention(query[start:end], key[start:end], value[start:end], scale)
            else:
                out[start:end] = self._prefill_with_context(
                    query[start:end], k_cache, v_cache, batch.prefill_block_tables[p], seq_len, scale
                )
            start = end
        return out

    # ------------------------------------------------------------------ decode

    def _decode(
        self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        if self._decode_on_kernel(query.dtype, k_cache):
            # the kernel reads the first len(query) tables and lengths: no slices to dispatch per layer
            return self._cpu_decode(query, k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, scale)
        plan = self._decode_plan(batch, k_cache.shape[1], query.device)
        num_seqs = query.shape[0]
        length = plan.blocks_per_seq * k_cache.shape[1]
        keys = self._gather("k", k_cache, plan.block_ids).view(num_seqs, length, *k_cache.shape[2:])
        values = self._gather("v", v_cache, plan.block_ids).view(num_seqs, length, *v_cache.shape[2:])
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [B, Hq, 1, D]
            keys.transpose(1, 2),  # [B, Hkv, L, D]
            values.transpose(1, 2),
            attn_mask=plan.mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _decode_plan(self, batch: ForwardBatch, block_size: int, device: torch.device) -> _DecodePlan:
        if self._plan_batch is batch and self._plan is not None:
            return self._plan
        blocks_per_seq = -(-batch.decode_max_seq_len // block_size)
        tables = batch.decode_block_tables[: batch.num_decodes, :blocks_per_seq]
        length = blocks_per_seq * block_size
        positions = torch.arange(length, device=device)
        seq_lens = batch.decode_seq_lens.to(device=device, dtype=torch.int64)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]
        plan = _DecodePlan(tables.reshape(-1).to(device=device, dtype=torch.int64), blocks_per_seq, mask)
        self._plan_batch, self._plan = batch, plan
        return plan

    def _gather(self, name: str, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """``cache[block_ids]`` into a reused buffer (grown when needed)."""
        count = block_ids.shape[0]
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.shape[0] < count
            or buffer.shape[1:] != cache.shape[1:]
            or buffer.dtype != cache.dtype
            or buffer.device != cache.device
        ):
            buffer = torch.empty((count, *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
            self._buffers[name] = buffer
        out = buffer[:count]
        torch.index_select(cache, 0, block_ids, out=out)
        return out

    # ------------------------------------------------------------------ prefill

    def _decode_on_kernel(self, dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
        """Whether decodes attend on the C++ kernel: a CPU cache of the queries' dtype, float32 or bf16."""
        return (self._cpu_decode is not None and k_cache.device.type == "cpu" and dtype == k_cache.dtype
                and dtype in (torch.float32, torch.bfloat16))

    def _prefill_on_kernel(self, dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
        """Whether the decode kernel takes the prefill rows too: a bf16 cache on its AVX512-BF16 path."""
        if dtype != torch.bfloat16 or not self._decode_on_kernel(dtype, k_cache):
            return False
        head_dim = k_cache.shape[-1]
        if head_dim not in self._rows_on_kernel:
            self._rows_on_kernel[head_dim] = bool(load_cpu_ops().paged_decode_bf16_runs(head_dim))
        return self._rows_on_kernel[head_dim]

    def _row_plan(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row as one query for the kernel: (block tables [T, width] int32, lengths [T] int32).

        A decode keeps its table and length; row i of a prefill chunk of ``q_len`` rows in a sequence of
        ``seq_len`` takes the chunk's table and length ``seq_len - q_len + i + 1``: its causal prefix.
        Built once per batch and reused by every layer.
        """
        if self._rows_batch is batch and self._rows is not None:
            return self._rows
        num_decodes = batch.num_decodes
        decode_tables, prefill_tables = batch.decode_block_tables[:num_decodes], batch.prefill_block_tables
        width = max(decode_tables.shape[1] if num_decodes else 0, prefill_tables.shape[1])
        tables, lens = [], []
        if num_decodes:
            tables.append(F.pad(decode_tables, (0, width - decode_tables.shape[1])))
            lens.append(batch.decode_seq_lens[:num_decodes])
        for p, (q_len, seq_len) in enumerate(zip(batch.prefill_query_lens, batch.prefill_seq_lens)):
            tables.append(F.pad(prefill_tables[p], (0, width - prefill_tables.shape[1])).expand(q_len, width))
            lens.append(torch.arange(seq_len - q_len + 1, seq_len + 1, dtype=torch.int32))
        self._rows_batch = batch
        self._rows = (torch.cat(tables).to(torch.int32).contiguous(), torch.cat(lens).to(torch.int32))
        return self._rows

    def _prefill_with_context(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Chunk attending to everything cached before it plus itself (already written to the cache)."""
        block_size = k_cache.shape[1]
        num_blocks = -(-seq_len // block_size)
        block_ids = block_table[:num_blocks].to(device=query.device, dtype=torch.int64)
        keys = k_cache.index_select(0, block_ids).flatten(0, 1)[:seq_len]  # [S, Hkv, D]
        values = v_cache.index_select(0, block_ids).flatten(0, 1)[:seq_len]
        q_len = query.shape[0]
        # query i sits at position seq_len - q_len + i and sees keys up to and including it
        query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


def _causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal self-attention of one whole sequence, [T, H, D] in and out."""
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        key.transpose(0, 1).unsqueeze(0),
        value.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def write_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy each row's K/V [T, Hkv, D] into its cache slot (slot = block * block_size + offset)."""
    # .view (not reshape) so a non-contiguous cache fails loudly instead of writing into a copy
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class TritonPagedAttention:
    """The same contract as ``TorchPagedAttention``, on the Triton kernels of ``tidal.kernels``."""

    name = "triton"

    def __init__(self) -> None:
        from tidal import kernels

        self._write = kernels.reshape_and_cache
        self._decode = kernels.paged_decode_attention
        self._prefill = kernels.paged_prefill_attention

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        self._write(key, value, k_cache, v_cache, batch.slot_mapping)
        num_decodes = batch.num_decodes
        if batch.num_prefills == 0:
            return self._decode(query, k_cache, v_cache, batch.decode_block_tables, batch.decode_seq_lens, scale)
        out = torch.empty_like(query)
        if num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], k_cache, v_cache, batch.decode_block_tables,
                                             batch.decode_seq_lens, scale)
        out[num_decodes:] = self._prefill(
            query[num_decodes:], k_cache, v_cache, batch.prefill_block_tables, batch.prefill_query_start_loc,
            batch.prefill_seq_lens_tensor, scale, max_query_len=max(batch.prefill_query_lens))
        return out


def select_attention_backend(name: str, device: torch.device):
    """The attention backend for ``EngineConfig.attention_backend`` on ``device``: the one place it is chosen.

    ``auto``: the Triton kernels on CUDA (when triton is installed), torch on CPU. ``triton`` on a
    CPU runs the kernels in Triton's interpreter: correct but thousands of times slower, for
    checking the kernels end to end without a GPU.
    """
    from tidal.kernels import HAS_TRITON

    if name == "auto":
        name = "triton" if device.type == "cuda" and HAS_TRITON else "torch"
    if name == "torch":
        return TorchPagedAttention(device)
    if name == "triton":
        if not HAS_TRITON:
            raise ValueError("--attention-backend triton needs triton (pip install 'tidal[cuda]')")
        if device.type == "cpu":
            import os
            import sys

            if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("--attention-backend triton on CPU needs TRITON_INTERPRET=1 before triton loads")
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, at first use
        return TritonPagedAttention()
    raise ValueError(f"unknown attention backend {name!r}; expected 'auto', 'torch' or 'triton'")
