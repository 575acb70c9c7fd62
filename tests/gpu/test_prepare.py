"""ModelRunner._prepare: a scheduled batch's rows, block tables and sampled rows, against a row-by-row reference.

The runner builds a pass's tensors in flat loops and, for a decode-only batch (the steady state), shares its
empty prefill fields between passes; this checks every field of both shapes of batch, including a one-token
entry that is not a decode (a prompt chunk short of the end: it computes a row but samples nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tidal.gpu.model_runner import ModelRunner
from tidal.wire import EngineConfig

BLOCK_SIZE = 16


@dataclass
class Seq:
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # a speculative proposal after the last token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(EngineConfig(model="tidal-tiny", dtype="float32", num_kv_blocks=64, block_size=BLOCK_SIZE))


@st.composite
def entry(draw, one_token: bool):
    n = draw(st.integers(2, 120))
    if one_token:  # a decode (its last token), or a one-token chunk further back
        computed = draw(st.sampled_from([n - 1, draw(st.integers(0, n - 1))]))
        num_new = 1
    else:
        computed = draw(st.integers(0, n - 2))
        num_new = draw(st.integers(2, n - computed))
    blocks = draw(st.permutations(range(64)))[:-(-n // BLOCK_SIZE)]
    return Seq(draw(st.lists(st.integers(0, 999), min_size=n, max_size=n)), computed, list(blocks)), num_new


batches = st.tuples(st.lists(entry(True), max_size=4), st.lists(entry(False), max_size=3)).map(
    lambda parts: parts[0] + parts[1]).filter(bool)


@settings(max_examples=150, deadline=None)
@given(entries=batches)
def test_prepare_matches_a_row_by_row_reference(runner, entries):
    batch = runner._prepare(entries)
    ids, positions, slots, sampled = [], [], [], []
    for seq, num_new in entries:
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            sampled.append(len(ids) - 1)
    assert batch.input_ids.tolist() == ids
    assert batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots
    assert batch.logits_indices.tolist() == sampled

    num_decodes = next((i for i, (_, n) in enumerate(entries) if n != 1), len(entries))
    decodes, prefills = entries[:num_decodes], entries[num_decodes:]
    assert batch.num_decodes == num_decodes
    assert batch.decode_seq_lens.tolist() == [seq.num_computed_tokens + 1 for seq, _ in decodes]
    for row, (seq, _) in zip(batch.decode_block_tables.tolist(), decodes, strict=True):
        assert row[:len(seq.block_table)] == seq.block_table and not any(row[len(seq.block_table):])
    assert batch.prefill_query_lens == [n for _, n in prefills]
    assert batch.prefill_seq_lens == [seq.num_computed_tokens + n for seq, n in prefills]
    assert batch.prefill_seq_lens_tensor.tolist() == batch.prefill_seq_lens
    starts = [0]
    for _, n in prefills:
        starts.append(starts[-1] + n)
    assert batch.prefill_query_start_loc.tolist() == starts
    assert batch.prefill_block_tables.shape[0] == len(prefills)
    for row, (seq, _) in zip(batch.prefill_block_tables.tolist(), prefills, strict=True):
        assert row[:len(seq.block_table)] == seq.block_table and not any(row[len(seq.block_table):])
    for tensor in (batch.decode_seq_lens, batch.decode_block_tables, batch.prefill_query_start_loc,
                   batch.prefill_seq_lens_tensor, batch.prefill_block_tables):
        assert tensor.dtype == torch.int32
    for tensor in (batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices):
        assert tensor.dtype == torch.int64
