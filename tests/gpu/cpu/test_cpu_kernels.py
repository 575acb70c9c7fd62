"""The C++ CPU decode attention computes what the torch path (gather + SDPA) and a dense
reference compute, over ragged lengths, GQA ratios, head dims, block sizes, shuffled block ids and
garbage in every cache slot no sequence owns."""

from __future__ import annotations

import os

import pytest
import torch
from crowded_threads import alone_and_crowded

from tidal.gpu.cpu import kernels as cpu_kernels
from tidal.gpu.model.attention import TorchPagedAttention, write_kv_cache
from tidal.gpu.forward_batch import ForwardBatch


@pytest.fixture(scope="module")
def kernel():
    loaded = cpu_kernels.load_decode_kernel()
    if loaded is None:
        pytest.skip("the C++ kernel could not be built here (TIDAL_CPU_KERNELS=0 or no working compiler; "
                    "see the logged warning)")
    return loaded


def make_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0, garbage=1e3):
    """A paged cache holding each sequence's K/V in shuffled blocks, every other slot full of ``garbage``."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks no one owns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype)
    v_cache = torch.full(shape, garbage, dtype=dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1  # padded table: the tail entries name block 0, never read
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    dense = []
    for s, n in enumerate(seq_lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for b in range(blocks_per_seq[s]):
            block = ids.pop()
            tables[s, b] = block
            rows = slice(b * block_size, min(n, (b + 1) * block_size))
            k_cache[block, : rows.stop - rows.start] = k[rows]
            v_cache[block, : rows.stop - rows.start] = v[rows]
        dense.append((k, v))
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32), dense


def dense_reference(query, dense, scale):
    """Plain softmax attention per sequence in float64, query head h on kv head h // group."""
    outs = []
    group = query.shape[1] // dense[0][0].shape[1]
    for q, (k, v) in zip(query.double(), dense):
        k = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", q, k) * scale, dim=-1)
        outs.append(torch.einsum("hl,lhd->hd", weights, v))
    return torch.stack(outs)


def torch_path(query, k_cache, v_cache, tables, seq_lens, scale):
    attention = TorchPagedAttention()
    attention._cpu_decode = None  # force the gather + SDPA path the kernel replaces
    batch = ForwardBatch(
        input_ids=torch.zeros(len(seq_lens), dtype=torch.int64), positions=torch.zeros(0), slot_mapping=torch.zeros(0),
        num_decodes=len(seq_lens), decode_block_tables=tables, decode_seq_lens=seq_lens,
        decode_max_seq_len=int(seq_lens.max()), prefill_query_lens=[], prefill_seq_lens=[],
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32), prefill_seq_lens_tensor=torch.zeros(0),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32), logits_indices=torch.zeros(0, dtype=torch.int64))
    return attention._decode(query, k_cache, v_cache, batch, scale)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_torch_path_and_dense_reference(kernel, group, head_dim, block_size):
    seq_lens = [1, block_size, block_size + 1, 2 * block_size - 1, 3 * block_size, 77, 200]
    num_kv_heads = 2
    case = make_case(seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, seed=group * head_dim)
    query, k_cache, v_cache, tables, lens, dense = case
    scale = head_dim**-0.5
    out = kernel(query, k_cache, v_cache, tables, lens, scale)
    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, torch_path(query, k_cache, v_cache, tables, lens, scale), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, scale), rtol=1e-5, atol=1e-5)


def test_never_reads_slots_outside_the_sequence(kernel):
    # NaN in every unowned slot (tails of last blocks, spare blocks): one read would poison the output
    query, k_cache, v_cache, tables, lens, dense = make_case([5, 16, 40], 8, 2, 64, 16, garbage=float("nan"))
    out = kernel(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, 0.125), rtol=1e-5, atol=1e-5)


def test_large_scores_stay_finite(kernel):
    # scores in the hundreds: softmax must subtract the max, not overflow exp
    query, k_cache, v_cache, tables, lens, dense = make_case([33, 300], 4, 2, 64, 16, seed=3)
    out = kernel(query * 30, k_cache, v_cache, tables, lens, 1.0)
    torch.testing.assert_close(out.double(), dense_reference(query * 30, dense, 1.0), rtol=1e-5, atol=1e-5)


def test_strided_query_and_partial_table(kernel):
    # the engine passes a row slice of its block tables and a query view taken out of a fused projection
    query, k_cache, v_cache, tables, lens, dense = make_case([20, 50, 9], 4, 2, 64, 16, seed=5)
    fused = torch.cat([query, torch.randn_like(query)], dim=1)  # [B, 2 * Hq, D]: query is a strided view
    wide = torch.cat([tables, torch.zeros_like(tables)], dim=1)
    out = kernel(fused[:, :4], k_cache, v_cache, wide, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, 0.125), rtol=1e-5, atol=1e-5)


# bf16 caches run csrc/paged_decode_bf16.cpp where the CPU has AVX512-BF16 and the head dim is a multiple
# of 32 (64, 96, 128 here), the generic kernel elsewhere (80; every head dim on other CPUs): both must hold.
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_bfloat16_cache(kernel, group, head_dim, block_size):
    seq_lens = [1, 2, block_size, block_size + 1, 31, 64, 130]
    query, k_cache, v_cache, tables, lens, dense = make_case(seq_lens, 2 * group, 2, head_dim, block_size,
                                                             torch.bfloat16, seed=group + head_dim)
    out = kernel(query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    assert out.dtype == torch.bfloat16
    # the output is rounded to bf16 (relative 2^-9) and so are the softmax weights on the AVX512-BF16 path
    torch.testing.assert_close(out.double(), dense_reference(query, dense, head_dim**-0.5), rtol=1e-2, atol=1e-2)


def test_bfloat16_never_reads_slots_outside_the_sequence(kernel):
    # odd lengths leave a lone last row, which the bf16 path pairs with zeros, never with the slot after it
    query, k_cache, v_cache, tables, lens, dense = make_case([5, 16, 41, 3], 8, 2, 64, 16, torch.bfloat16,
                                                             garbage=float("nan"))
    out = kernel(query, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, 0.125), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_result_does_not_depend_on_thread_count(kernel, dtype):
    # with fewer sequences than threads the bf16 path splits a sequence's kv heads over tasks: same sums
    case = make_case([3, 17, 64, 100, 250, 1] * 4, 4, 2, 64, 16, dtype, seed=7)
    single_seq = make_case([300], 8, 4, 64, 16, dtype, seed=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = kernel(*case[:5], 0.125), kernel(*single_seq[:5], 0.125)
        torch.set_num_threads(max(2, os.cpu_count() or 2))
        multi = kernel(*case[:5], 0.125), kernel(*single_seq[:5], 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single[0], multi[0]) and torch.equal(single[1], multi[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threads_that_take_over_sequences_give_the_one_thread_result(kernel, dtype):
    # csrc/claims.h (bf16 path): with four times more threads than cores, threads are preempted and the
    # others take over their last sequences; each sequence is still attended exactly once
    case = make_case([3, 17, 64, 100, 250, 1, 40, 9] * 3, 4, 2, 64, 16, dtype, seed=9)
    alone, crowded = alone_and_crowded(lambda: kernel(*case[:5], 0.125))
    assert all(torch.equal(out, alone) for out in crowded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_op_writes_what_index_copy_writes(kernel, dtype):
    # key and value as the qkv projection leaves them: strided views of one [T, (Hq + 2 Hkv) * D] tensor
    gen = torch.Generator().manual_seed(4)
    rows, kv_heads, dim, blocks, block_size = 21, 2, 64, 7, 16
    qkv = torch.randn(rows, 8 * kv_heads * dim, generator=gen).to(dtype)
    _, key, value = qkv.split((6 * kv_heads * dim, kv_heads * dim, kv_heads * dim), dim=1)
    key, value = key.view(rows, kv_heads, dim), value.view(rows, kv_heads, dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:rows]
    k_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, k_expected, v_expected, slots)
    torch.ops.tidal_cpu.write_kv_cache_(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_cache_write_op_takes_rows_whose_heads_are_not_contiguous(kernel):
    key = torch.randn(5, 64, 2).transpose(1, 2)  # [5, 2, 64], head_dim strided
    value = torch.randn(5, 2, 64)
    slots = torch.tensor([9, 0, 31, 17, 4])
    k_cache, v_cache = torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    write_kv_cache(key, value, k_expected, v_expected, slots)
    torch.ops.tidal_cpu.write_kv_cache_(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


@pytest.mark.parametrize("bad_slot", [-1, 7 * 16])
def test_cache_write_op_refuses_a_slot_outside_the_cache_and_writes_nothing(kernel, bad_slot):
    key, value = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    k_cache, v_cache = torch.zeros(7, 16, 2, 64), torch.zeros(7, 16, 2, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.tidal_cpu.write_kv_cache_(key, value, k_cache, v_cache, torch.tensor([0, 5, bad_slot]))
    assert not k_cache.any() and not v_cache.any()


def test_cache_write_op_refuses_a_dtype_other_than_the_cache(kernel):
    # the attention backend converts with index_copy_ then; the op itself never converts silently
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.tidal_cpu.write_kv_cache_(torch.randn(1, 2, 64), torch.randn(1, 2, 64),
                                            torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16),
                                            torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16), torch.tensor([3]))


def test_rejects_block_ids_outside_the_cache(kernel):
    query, k_cache, v_cache, tables, lens, _ = make_case([20, 5], 4, 2, 64, 16)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel(query, k_cache, v_cache, bad, lens, 0.125)
    with pytest.raises(RuntimeError, match="length"):
        kernel(query, k_cache, v_cache, tables, torch.tensor([20, 0], dtype=torch.int32), 0.125)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_ops", None)
    assert cpu_kernels.load_decode_kernel() is None
    assert TorchPagedAttention()._cpu_decode is None


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error this source does not compile\n")
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_kernels, "_SOURCES", [broken])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))  # keep the real build's cache clean
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_ops", None)
    with caplog.at_level("WARNING", logger="tidal.gpu.cpu.kernels"):
        assert cpu_kernels.load_decode_kernel() is None
        assert cpu_kernels.load_decode_kernel() is None  # not retried
    warnings = [r.getMessage() for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "does not compile" in warnings[0], warnings  # says why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_decodes_and_prefill_chunks(kernel, dtype):
    # Two decodes, a prefill chunk after 32 cached rows and a whole-prompt prefill, through the layer's
    # forward: on the AVX512-BF16 path every row goes through the kernel (a prefill row is one query over
    # its causal prefix), elsewhere prefills take SDPA. Both must give causal attention row by row.
    block_size, lens, query_lens = 16, [20, 33, 40, 13], [1, 1, 8, 13]
    _, k_cache, v_cache, tables, _, dense = make_case(lens, 8, 2, 64, block_size, dtype, seed=11,
                                                      garbage=float("nan"))
    rows = [(s, pos) for s, (n, q) in enumerate(zip(lens, query_lens)) for pos in range(n - q, n)]
    query = torch.randn(len(rows), 8, 64, generator=torch.Generator().manual_seed(12)).to(dtype)
    key = torch.stack([dense[s][0][pos] for s, pos in rows])
    value = torch.stack([dense[s][1][pos] for s, pos in rows])
    slots = torch.tensor([int(tables[s, pos // block_size]) * block_size + pos % block_size for s, pos in rows])
    batch = ForwardBatch(
        input_ids=torch.zeros(len(rows), dtype=torch.int64), positions=torch.tensor([pos for _, pos in rows]),
        slot_mapping=slots, num_decodes=2, decode_block_tables=tables[:2], decode_seq_lens=torch.tensor(
            lens[:2], dtype=torch.int32), decode_max_seq_len=33, prefill_query_lens=query_lens[2:],
        prefill_seq_lens=lens[2:], prefill_query_start_loc=torch.tensor([0, 8, 21], dtype=torch.int32),
        prefill_seq_lens_tensor=torch.tensor(lens[2:], dtype=torch.int32), prefill_block_tables=tables[2:],
        logits_indices=torch.zeros(0, dtype=torch.int64))
    out = TorchPagedAttention().forward(query, key, value, k_cache, v_cache, batch, 0.125)
    expected = torch.cat([
        dense_reference(query[i:i + 1], [(dense[s][0][:pos + 1], dense[s][1][:pos + 1])], 0.125)
        for i, (s, pos) in enumerate(rows)])
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)
