"""CPU decode attention with the KV cache in DRAM, as in a served step, and prefill attention rows.

    PYTHONPATH=<checkout> python benchmarks/cpu_attention_dram.py [--dtype bfloat16] [--heads 12]
        [--kv-heads 4] [--batches 16] [--contexts 192 512] [--layers 12] [--threads 1]

Decode: one ``paged_decode_attention`` call per layer over ``--layers`` caches of 8192 blocks each (so a
step's K/V do not fit in the L3, as in serving), with each batch's blocks laid out three ways: shared by
every row (the data stays in L2: the kernel's arithmetic), contiguous, and scattered through the cache.
Prints microseconds per layer (this thread's CPU time, median of 7; with more threads use wall time),
the K/V bytes read per second and multiply-adds per second. Run it with PYTHONPATH naming two checkouts
in turn to compare kernels (the op picks its own path for the dtype and CPU).

Prefill (``--prefill``): one prompt chunk's causal attention, SDPA (the path for float32) against the
kernel taking each row as one query over its prefix (the path on AVX512-BF16), same inputs.
Defaults are the small anchor model's shape (12 heads, 4 kv heads, head dim 64, block 16).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.nn.functional as F

from tidal.gpu.cpu.kernels import load_cpu_ops

HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 64, 16, 8192


def clock(threads: int):
    return time.thread_time if threads == 1 else time.perf_counter


def median_seconds(fn, now, rounds: int = 7) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        start = now()
        fn()
        samples.append(now() - start)
    return statistics.median(samples)


def every_layer(ops, caches, query, tables, lens) -> None:
    for k, v in caches:
        ops.paged_decode_attention(query, k, v, tables, lens, HEAD_DIM**-0.5)


def sdpa_rows(query, keys, values, mask):
    return F.scaled_dot_product_attention(
        query.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
        attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True)[0].transpose(0, 1)


def kernel_rows(ops, query, k_cache, v_cache, tables, lens):
    return ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, HEAD_DIM**-0.5)


def decode(ops, args, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    shape = (NUM_BLOCKS, BLOCK_SIZE, args.kv_heads, HEAD_DIM)
    caches = [(torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))
              for _ in range(args.layers)]
    now = clock(args.threads)
    print("| batch | context | blocks | us/layer | GB/s | GMAC/s |\n|---:|---:|---|---:|---:|---:|")
    for batch in args.batches:
        for context in args.contexts:
            blocks = -(-context // BLOCK_SIZE)
            layouts = {"shared": torch.arange(blocks).repeat(batch, 1),
                       "contiguous": torch.arange(batch * blocks).view(batch, blocks),
                       "scattered": torch.randperm(NUM_BLOCKS, generator=gen)[: batch * blocks].view(batch, blocks)}
            lens = torch.full((batch,), context, dtype=torch.int32)
            query = torch.randn(batch, args.heads, HEAD_DIM, generator=gen).to(dtype)
            for name, tables in layouts.items():
                tables = tables.to(torch.int32).contiguous()

                step = functools.partial(every_layer, ops, caches, query, tables, lens)
                us = median_seconds(step, now) / args.layers * 1e6
                kv_bytes = batch * context * args.kv_heads * HEAD_DIM * dtype.itemsize * 2
                macs = batch * args.heads * context * HEAD_DIM * 2
                print(f"| {batch} | {context} | {name} | {us:.1f} | {kv_bytes / us / 1e3:.2f} | {macs / us / 1e3:.1f} |")


def prefill(ops, args, dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    now = clock(args.threads)
    print("| prompt rows | cached before | SDPA us | kernel us | ratio | max abs diff |\n|---:|---:|---:|---:|---:|---:|")
    for rows, cached in ((128, 0), (512, 0), (128, 384)):
        total = cached + rows
        blocks = -(-total // BLOCK_SIZE)
        k_cache = torch.randn(blocks + 5, BLOCK_SIZE, args.kv_heads, HEAD_DIM, generator=gen).to(dtype)
        v_cache = torch.randn(blocks + 5, BLOCK_SIZE, args.kv_heads, HEAD_DIM, generator=gen).to(dtype)
        table = torch.randperm(blocks + 5, generator=gen)[:blocks].to(torch.int32)
        query = torch.randn(rows, args.heads, HEAD_DIM, generator=gen).to(dtype)
        keys = k_cache[table.long()].flatten(0, 1)[:total]
        values = v_cache[table.long()].flatten(0, 1)[:total]
        mask = torch.arange(total)[None, :] <= torch.arange(cached, total)[:, None]
        tables = table[None].expand(rows, -1)
        lens = torch.arange(cached + 1, total + 1, dtype=torch.int32)

        sdpa = functools.partial(sdpa_rows, query, keys, values, mask)
        kernel = functools.partial(kernel_rows, ops, query, k_cache, v_cache, tables, lens)
        times = {name: median_seconds(fn, now) * 1e6 for name, fn in (("sdpa", sdpa), ("kernel", kernel))}
        diff = (sdpa().float() - kernel().float()).abs().max().item()
        print(f"| {rows} | {cached} | {times['sdpa']:.0f} | {times['kernel']:.0f} | "
              f"{times['sdpa'] / times['kernel']:.1f}x | {diff:.4f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--batches", type=int, nargs="+", default=[16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[192, 512])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prefill", action="store_true", help="prefill rows: SDPA against the kernel")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = load_cpu_ops()
    if ops is None:
        raise SystemExit("the C++ kernels are unavailable here (TIDAL_CPU_KERNELS=0 or the build failed)")
    dtype = getattr(torch, args.dtype)
    print(f"torch threads {args.threads}; {args.dtype}; {args.heads} heads, {args.kv_heads} kv heads, head dim "
          f"{HEAD_DIM}, block {BLOCK_SIZE}; {'thread CPU' if args.threads == 1 else 'wall'} time\n")
    (prefill if args.prefill else decode)(ops, args, dtype)


if __name__ == "__main__":
    main()
