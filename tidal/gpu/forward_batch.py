"""The tensors one forward pass needs, built by the model runner from a scheduled batch.

Token layout: the single-token decodes come first (one row each), then each prefill chunk
(a new prompt, the next chunk of a long prompt, or a recompute after preemption) as a
contiguous run of rows. New K/V of every row are written to ``slot_mapping`` before
attention reads the cache, so a prefill chunk sees its own keys and every earlier chunk's.

KV cache layout (per layer): ``k_cache`` and ``v_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``; slot = block_id * block_size + offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.gpu.model.lora import LoraRows


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each row's K/V go in the cache
    # decodes: rows [0, num_decodes)
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32 (padded with 0)
    decode_seq_lens: torch.Tensor  # [num_decodes] int32: context length incl. the new token
    decode_max_seq_len: int
    # prefills: rows [num_decodes, T), sequence p owns rows num_decodes + query_start_loc[p] ...
    prefill_query_lens: list[int]
    prefill_seq_lens: list[int]  # context length incl. this chunk
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, relative to num_decodes
    prefill_seq_lens_tensor: torch.Tensor  # [num_prefills] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    # rows whose logits are needed (the last row of every sequence that samples this step)
    logits_indices: torch.Tensor  # [num_sampled] int64
    # which LoRA slot each row runs through (model/lora.py); None: every row is the base model's
    lora: LoraRows | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_query_lens)
