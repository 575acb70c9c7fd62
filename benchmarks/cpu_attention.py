"""CPU decode attention, per layer: the torch path (gather + SDPA) against the C++ kernel.

tidal-tiny shapes (4 query heads, 2 kv heads, head dim 64, block size 16, float32), batch 1..256,
context 256 and 1024, at 1 and 2 torch threads. Every sequence's blocks are shuffled through the
cache, as after some serving. Prints milliseconds per call (the median of a few timed rounds) and
the speedup.

Usage: OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_attention.py [--batches 1 8 64 256]
       [--contexts 256 1024] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tidal.gpu.model.attention import TorchPagedAttention# noqa: E402
from tidal.gpu.cpu.kernels import load_decode_kernel# noqa: E402
from tidal.gpu.forward_batch import ForwardBatch  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 4, 2, 64, 16


def decode_batch(batch: int, context: int) -> tuple[torch.Tensor, ...]:
    """(query, k_cache, v_cache, block_tables, seq_lens, ForwardBatch) with ragged lengths near ``context``."""
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    lens = torch.randint(max(1, context * 3 // 4), context + 1, (batch,), generator=gen, dtype=torch.int32)
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * blocks].to(torch.int32).view(batch, blocks)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=gen)
    fb = ForwardBatch(
        input_ids=torch.zeros(batch, dtype=torch.int64), positions=torch.zeros(0), slot_mapping=torch.zeros(0),
        num_decodes=batch, decode_block_tables=tables, decode_seq_lens=lens, decode_max_seq_len=int(lens.max()),
        prefill_query_lens=[], prefill_seq_lens=[], prefill_query_start_loc=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens_tensor=torch.zeros(0), prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32),
        logits_indices=torch.zeros(0, dtype=torch.int64))
    return query, k_cache, v_cache, tables, lens, fb


def time_ms(fn, rounds: int = 5) -> float:
    """Median milliseconds per call over ``rounds`` rounds of enough calls to last ~20 ms each."""
    fn()
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    calls = max(1, int(0.02 / max(once, 1e-6)))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    start = time.perf_counter()
    kernel = load_decode_kernel()
    print(f"kernel load: {time.perf_counter() - start:.2f} s")
    if kernel is None:
        sys.exit("the C++ kernel is unavailable (TIDAL_CPU_KERNELS=0 or the build failed); nothing to compare")
    reference = TorchPagedAttention()
    reference._cpu_decode = None  # the gather + SDPA path

    scale = HEAD_DIM**-0.5
    print(f"{'threads':>7} {'batch':>5} {'context':>7} {'torch ms':>9} {'kernel ms':>9} {'speedup':>7}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for context in args.contexts:
            for batch in args.batches:
                query, k_cache, v_cache, tables, lens, fb = decode_batch(batch, context)
                torch_ms = time_ms(lambda: reference._decode(query, k_cache, v_cache, fb, scale))
                kernel_ms = time_ms(lambda: kernel(query, k_cache, v_cache, tables, lens, scale))
                print(f"{threads:>7} {batch:>5} {context:>7} {torch_ms:>9.3f} {kernel_ms:>9.3f} "
                      f"{torch_ms / kernel_ms:>6.1f}x")


if __name__ == "__main__":
    main()
