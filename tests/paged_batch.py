"""A minimal paged "runner" for model tests: sequences, a scrambled block allocator and ForwardBatch building."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidal.gpu.forward_batch import ForwardBatch
from tidal.gpu.model.config import ModelConfig

BLOCK_SIZE = 4  # small, so every sequence spans several (non-adjacent) blocks
NUM_BLOCKS = 64
MAX_BLOCKS_PER_SEQ = 12


@dataclass
class Sequence:
    tokens: list[int]  # every token whose K/V is (or is about to be) in the cache
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0


class PagedCache:
    """KV caches plus a block allocator that hands out blocks in a scrambled order."""

    def __init__(self, config: ModelConfig) -> None:
        shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_kv_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist()

    def reserve(self, seq: Sequence, length: int) -> None:
        while len(seq.blocks) * BLOCK_SIZE < length:
            seq.blocks.append(self.free.pop())


def build_batch(cache: PagedCache, decodes: list[Sequence], prefills: list[tuple[Sequence, int]]) -> ForwardBatch:
    """One step: each decode computes its last token; each prefill computes its next ``n`` tokens."""
    input_ids, positions, slots, logits_indices = [], [], [], []

    def add_rows(seq: Sequence, count: int) -> None:
        cache.reserve(seq, seq.num_cached + count)
        for pos in range(seq.num_cached, seq.num_cached + count):
            input_ids.append(seq.tokens[pos])
            positions.append(pos)
            slots.append(seq.blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        seq.num_cached += count
        logits_indices.append(len(input_ids) - 1)

    def tables(seqs: list[Sequence]) -> torch.Tensor:
        table = torch.zeros(len(seqs), MAX_BLOCKS_PER_SEQ, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table[i, : len(seq.blocks)] = torch.tensor(seq.blocks)
        return table

    for seq in decodes:
        assert seq.num_cached == len(seq.tokens) - 1
        add_rows(seq, 1)
    query_lens, seq_lens = [], []
    for seq, count in prefills:
        add_rows(seq, count)
        query_lens.append(count)
        seq_lens.append(seq.num_cached)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        num_decodes=len(decodes),
        decode_block_tables=tables(decodes),
        decode_seq_lens=torch.tensor([s.num_cached for s in decodes], dtype=torch.int32),
        decode_max_seq_len=max((s.num_cached for s in decodes), default=0),
        prefill_query_lens=query_lens,
        prefill_seq_lens=seq_lens,
        prefill_query_start_loc=torch.tensor(starts, dtype=torch.int32),
        prefill_seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        prefill_block_tables=tables([seq for seq, _ in prefills]),
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


def prompt_logits(model, config: ModelConfig, prompt: list[int]) -> torch.Tensor:
    """The model's float32 logits at every row of ``prompt``, prefilled in one batch."""
    cache = PagedCache(config)
    with torch.inference_mode():
        batch = build_batch(cache, [], [(Sequence(tokens=list(prompt)), len(prompt))])
        return model.compute_logits(model(batch, cache.kv_caches))


def greedy_tokens(model, config: ModelConfig, prompt: list[int], new_tokens: int) -> list[int]:
    """The model's greedy continuation of ``prompt``: the prompt's rows in one batch, then one row a step."""
    cache = PagedCache(config)
    seq = Sequence(tokens=list(prompt))
    batch = build_batch(cache, [], [(seq, len(prompt))])
    out = []
    with torch.inference_mode():
        while True:
            hidden = model(batch, cache.kv_caches)
            out.append(int(model.compute_logits(hidden[batch.logits_indices])[-1].argmax()))
            if len(out) == new_tokens:
                return out
            seq.tokens.append(out[-1])
            batch = build_batch(cache, [seq], [])
